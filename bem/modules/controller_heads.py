"""The controller's routing heads and gate as two matrix products over all tokens, and the per-level tensors
of `routing_stats()` computed only when asked for.

Each head is Linear -> GELU -> Linear: prefix on p_t, chunk on the chunk context, token on [z_t, p_t]; the gate
is one linear on [z_t, p_t]. Run one by one they cost three small products per layer, an add and an index_add
over the full (tokens, modules x rank) size, and a gate product. Stacked:

    first  = [z | p | ctx] @ W1^T + b1      W1: the three first layers and the gate row, each reading its slice
    hidden = GELU(first[:, :heads])
    dynamic = hidden @ W2^T + b2            W2: [prefix | chunk | token] second layers side by side; the token
                                            head's rows sit at its modules' rows, zero elsewhere

which is the same sum (prefix + chunk, plus token on token-routed modules) in one full-size product, and the
gate's logit is first[:, heads]. Under autograd the stacked weights are built from the heads' parameters in
the call (autograd reaches every parameter as before); at inference they are kept (`StackedWeights`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Iterator, Optional

import torch
import torch.nn as nn
import torch.nn.functional as F



def stacked_weights(controller: nn.Module) -> tuple[torch.Tensor, ...]:
    """(W1, b1, W2, b2) as in the module docstring; d = controller_dim, inputs [z | p | ctx] (3d wide)."""
    prefix, chunk, token, gate = controller.prefix_head, controller.chunk_head, controller.token_head, controller.gate
    d = prefix[0].in_features
    first_w = [F.pad(prefix[0].weight, (d, d)), F.pad(chunk[0].weight, (2 * d, 0))]
    first_b = [prefix[0].bias, chunk[0].bias]
    second_w = [prefix[2].weight, chunk[2].weight]
    second_b = prefix[2].bias + chunk[2].bias
    if token is not None:
        first_w.append(F.pad(token[0].weight, (0, d)))
        first_b.append(token[0].bias)
        M, r = controller.num_modules, controller.rank
        rows = controller.token_module_indices
        second_w.append(token[2].weight.new_zeros(M, r, d).index_copy(0, rows, token[2].weight.view(-1, r, d))
                        .view(M * r, d))
        second_b = second_b + token[2].bias.new_zeros(M, r).index_copy(0, rows, token[2].bias.view(-1, r)).view(-1)
    if gate is not None:
        first_w.append(F.pad(gate.weight, (0, d)))
        first_b.append(gate.bias)
    return torch.cat(first_w), torch.cat(first_b), torch.cat(second_w, dim=1), second_b


class StackedWeights:
    """`stacked_weights` kept between inference calls and made again when a head's parameter changes (in place:
    its version counter; replaced: its address). A refresh writes into the kept tensors where it can, so a
    CUDA graph that read them reads the new values at its next replay: `refresh` runs before every call,
    replayed or not. Thirteen small kernels less per call."""

    def __init__(self) -> None:
        self._kept: Optional[tuple[torch.Tensor, ...]] = None
        self._key: Optional[tuple] = None
        # set while the controller's own graphs capture a call (they refresh before each replay); a capture of
        # anyone else's makes the weights in the call, as it cannot know when to refresh them
        self.in_own_capture = False

    @contextlib.contextmanager
    def own_capture(self) -> Iterator[None]:
        self.in_own_capture = True
        try:
            yield
        finally:
            self.in_own_capture = False

    def usable(self, like: torch.Tensor) -> bool:
        """Whether a call on `like` may read the kept weights: no autograd, no compilation, and no capture but
        the controller's own."""
        if torch.is_grad_enabled() or torch.compiler.is_compiling():
            return False
        return not (like.is_cuda and torch.cuda.is_current_stream_capturing()) or self.in_own_capture

    @staticmethod
    def _parameters(controller: nn.Module) -> list[torch.Tensor]:
        modules = [controller.prefix_head[0], controller.prefix_head[2], controller.chunk_head[0],
                   controller.chunk_head[2]]
        if controller.token_head is not None:
            modules += [controller.token_head[0], controller.token_head[2]]
        if controller.gate is not None:
            modules.append(controller.gate)
        return [t for m in modules for t in (m.weight, m.bias)]

    def refresh(self, controller: nn.Module) -> None:
        params = self._parameters(controller)
        key = tuple((p._version, p.data_ptr(), p.dtype) for p in params)
        if key == self._key:
            return
        with torch.inference_mode(False), torch.no_grad():  # normal tensors: usable in any later pass
            made = stacked_weights(controller)
            kept = self._kept
            if kept is not None and all(k.shape == m.shape and k.dtype == m.dtype and k.device == m.device
                                        for k, m in zip(kept, made)):
                for k, m in zip(kept, made):
                    k.copy_(m)
            else:
                self._kept = made
        self._key = key

    def get(self, controller: nn.Module) -> tuple[torch.Tensor, ...]:
        self.refresh(controller)
        return self._kept


def first_layer(controller: nn.Module, z: torch.Tensor, p: torch.Tensor,
                chunk_ctx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(first (B, T, heads [+ 1 gate logit]), W2, b2) for features z, prefix p and chunk context (all (B, T, d)).
    Under autograd, compilation or a capture not the controller's own the stacked weights are made in the call."""
    if controller.stacked.usable(z):
        W1, b1, W2, b2 = controller.stacked.get(controller)
    else:
        W1, b1, W2, b2 = stacked_weights(controller)
    return F.linear(torch.cat([z, p, chunk_ctx], dim=-1), W1, b1), W2, b2


def second_layer(first: torch.Tensor, W2: torch.Tensor, b2: torch.Tensor) -> torch.Tensor:
    """dynamic (B, T, M*r) before the clamp, from the first layer's output."""
    return F.linear(F.gelu(first[..., : W2.shape[1]]), W2, b2)


def gate_logit(controller: nn.Module, first: torch.Tensor, W2: torch.Tensor) -> Optional[torch.Tensor]:
    """The gate's logit (B, T, 1), or None without a gate."""
    return first[..., W2.shape[1] :] if controller.gate is not None else None


def heads_and_gate(controller: nn.Module, z: torch.Tensor, p: torch.Tensor,
                   chunk_ctx: torch.Tensor) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    """(dynamic (B, T, M*r) before the clamp, gate logit (B, T, 1) or None) for features z, prefix p and chunk
    context (all (B, T, d))."""
    first, W2, b2 = first_layer(controller, z, p, chunk_ctx)
    return second_layer(first, W2, b2), gate_logit(controller, first, W2)


class RoutingLevels(Mapping):
    """The levels of an inference call, for `routing_stats()`: "gate" and "codes" as computed, and "prefix",
    "chunk", "token" and "dynamic" (the clamped sum) recomputed from the call's inputs when read. Nothing
    full-size is kept or computed for them in the call itself. Inside a replayed CUDA graph the inputs are the
    graph's own buffers: the levels are always those of its latest replay, as the codes are."""

    KEYS = ("prefix", "chunk", "dynamic", "token", "gate", "codes")

    def __init__(self, controller: nn.Module, z: torch.Tensor, p: torch.Tensor,
                 chunk_ctx: torch.Tensor, gate: Optional[torch.Tensor], codes: torch.Tensor) -> None:
        self._controller_ref = [controller]  # a list: no module registered, no cycle through it
        self._inputs = (z, p, chunk_ctx)
        self._gate, self._codes = gate, codes
        # the call's autocast, to recompute under: read later (routing_stats() after an evaluation under
        # autocast, say) low-precision inputs would meet the heads' float32 weights outside of it
        device_type = z.device.type
        self._autocast = (device_type, torch.is_autocast_enabled(device_type), torch.get_autocast_dtype(device_type))

    def __iter__(self) -> Iterator[str]:
        return iter(self.KEYS)

    def __len__(self) -> int:
        return len(self.KEYS)

    def __getitem__(self, key: str) -> Optional[torch.Tensor]:
        if key == "gate":
            return self._gate
        if key == "codes":
            return self._codes
        if key not in self.KEYS:
            raise KeyError(key)
        controller = self._controller_ref[0]
        z, p, chunk_ctx = self._inputs
        B, T, _ = z.shape
        M, r = controller.num_modules, controller.rank
        device_type, enabled, dtype = self._autocast
        with torch.no_grad(), torch.autocast(device_type, dtype=dtype, enabled=enabled):
            if key == "prefix":
                return controller.prefix_head(p).view(B, T, M, r)
            if key == "chunk":
                return controller.chunk_head(chunk_ctx).view(B, T, M, r)
            if key == "token":
                head = controller.token_head
                return None if head is None else head(torch.cat([z, p], dim=-1)).view(B, T, -1, r)
            dynamic, _ = heads_and_gate(controller, z, p, chunk_ctx)
            dynamic = dynamic.view(B, T, M, r)
            return dynamic * controller.clamp_scale(dynamic)
