"""`MixerBlock`: a sequence mixer bolted onto the residual stream after one decoder block (DESIGN §7).

    h  <-  h + W_out · M( norm(h) )          W_out zero-initialised

A forward hook on the decoder block applies it to the block's output hidden states: no model code is edited,
a freshly wrapped model is exactly the base model, and `disable_bem()` skips it. Its decode state rides on the
KV cache with the routing state (part "mixer.<block index>"), read from and left in the current call.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
import torch.nn as nn

from .hyena import HyenaMixer
from .mlstm import MLSTMMixer

if TYPE_CHECKING:
    from ...config import HierarchicalBEMConfig

from ...config import MIXERS  # noqa: F401  (re-exported)


def state_name(block_index: int) -> str:
    return f"mixer.{block_index}"


class MixerBlock(nn.Module):
    def __init__(self, hidden: int, config: "HierarchicalBEMConfig", block_index: int) -> None:
        super().__init__()
        self.kind, self.block_index = config.mixer, block_index
        self.max_length = config.mixer_max_length if config.mixer == "hyena" else None
        self.norm = nn.RMSNorm(hidden, eps=1e-6)
        if config.mixer == "hyena":
            self.mixer: nn.Module = HyenaMixer(hidden, config.mixer_dim, config.mixer_max_length,
                                               config.mixer_conv_size, config.use_fused_kernels)
        else:
            self.mixer = MLSTMMixer(hidden, config.mixer_dim, config.mixer_heads, config.mixer_conv_size,
                                    config.mixer_forget_bias, config.mixer_input_bias, config.use_fused_kernels)
        self.out_proj = nn.Linear(config.mixer_dim, hidden, bias=False)
        nn.init.zeros_(self.out_proj.weight)  # the wrapped model starts as the base model exactly

    def forward(self, hidden: torch.Tensor, call: Any) -> torch.Tensor:
        """hidden (B, T, hidden) after the decoder block; `call` is the current `CallState` (None outside a
        tracked call: a fresh sequence without padding)."""
        name = state_name(self.block_index)
        state = None if call is None else call.previous_part(name)
        mask = None if call is None else call.padding_mask
        if self.max_length is not None and call is not None:
            self._check_length(hidden.shape[1], call)
        want_state = call is not None and call.want_state
        mixed, new_state = self.mixer(self.norm(hidden), mask, state, want_state)
        if call is not None:
            call.set_part(name, new_state)
        return hidden + self.out_proj(mixed.to(self.out_proj.weight.dtype)).to(hidden.dtype)

    def _check_length(self, new_tokens: int, call: Any) -> None:
        """The Hyena filter covers `max_length` positions: refuse what would go past them."""
        seen = 0 if call.previous is None else call.previous.seen_tokens
        if seen is not None and seen + new_tokens > self.max_length:
            raise ValueError(
                f"this sequence would reach position {seen + new_tokens}, but the Hyena mixers' filters cover "
                f"mixer_max_length = {self.max_length} positions; raise mixer_max_length or use shorter sequences"
            )
        capacity = call.cache_capacity
        if call.previous is None and capacity is not None and capacity > self.max_length:
            raise ValueError(
                f"this static cache holds up to {capacity} positions, but the Hyena mixers' filters cover "
                f"mixer_max_length = {self.max_length}; raise mixer_max_length or generate fewer tokens"
            )


def attach(blocks: nn.ModuleList, mixer_blocks: dict[int, MixerBlock], current_call: Callable[[], Any],
           enabled: Callable[[], bool]) -> list[torch.utils.hooks.RemovableHandle]:
    """Run each mixer block on its decoder block's output (a tensor, or a tuple whose first item is one)."""
    handles = []
    for index, mixer_block in mixer_blocks.items():
        def after_block(module: nn.Module, args: tuple, output: Any, mixer_block: MixerBlock = mixer_block) -> Any:
            if not enabled():
                return None
            hidden = output[0] if isinstance(output, tuple) else output
            if not isinstance(hidden, torch.Tensor) or hidden.dim() != 3:
                raise ValueError(f"a mixer after block {mixer_block.block_index} needs the block's hidden states "
                                 f"(batch, sequence, hidden); the block returned {type(hidden).__name__}")
            mixed = mixer_block(hidden, current_call())
            return (mixed, *output[1:]) if isinstance(output, tuple) else mixed

        handles.append(blocks[index].register_forward_hook(after_block))
    return handles


def resolve_layers(layers: Any, count: int) -> list[int]:
    """Block indices from `mixer_layers` ("all" or a list, negative counting from the end), checked against the
    model's `count` blocks."""
    if layers == "all":
        return list(range(count))
    resolved = []
    for index in layers:
        if not -count <= index < count:
            raise ValueError(f"mixer_layers has block index {index}, but this model has {count} blocks "
                             f"(0..{count - 1}, or -{count}..-1 from the end)")
        resolved.append(index % count)
    if len(set(resolved)) != len(resolved):
        raise ValueError(f"mixer_layers names a block twice: {layers!r} (blocks {resolved})")
    return sorted(resolved)


