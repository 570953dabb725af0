"""The controller's codes handed to the wrapped layers as one buffer when a no-grad call is compiled.

Each wrapped layer's fused linear is an opaque custom op that reads its module's slice of the codes (modules,
batch, tokens, rank). Inductor computes a pointwise result where it is read: with one reader per module that it
cannot fuse into, it recomputed the controller's clamp, gate and combine for each slice, in a kernel of its own or
fused into the previous layer's pointwise work. A compiled decoding step of a 30-layer model (SmolLM-135M's
shapes, 210 wrapped linears, H100) ran about 220 more small kernels than the frozen model's, some 320 µs of
its device time. Through this op, which inductor cannot see into, the codes are computed once and each layer
reads a view of the one buffer, at the cost of one copy of the codes (a few KB at decode sizes).
"""

from __future__ import annotations

import torch


@torch.library.custom_op("bem::codes_buffer", mutates_args=())
def codes_buffer(codes: torch.Tensor) -> torch.Tensor:
    """A copy of `codes` (a custom op may not return its input): what the compiled graph cannot inline."""
    return codes.clone()


@codes_buffer.register_fake
def _(codes: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(codes)
