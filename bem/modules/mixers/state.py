"""The decode state of a mixer block, as it rides on the KV cache (`bem.cache_state.CarriedState`)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class MixerState:
    """Named tensors: `rows` are batch-first (one row per sequence), `shared` are the same for every row (a
    position counter); beams reorder and repeat the rows only."""

    rows: dict[str, torch.Tensor]
    shared: dict[str, torch.Tensor] = field(default_factory=dict)

    def tensors(self) -> list[torch.Tensor]:
        return [*self.rows.values(), *self.shared.values()]

    def index_select(self, index: torch.Tensor) -> "MixerState":
        return MixerState({k: v.index_select(0, index.to(v.device)) for k, v in self.rows.items()}, dict(self.shared))

    def repeat_interleave(self, repeats: int) -> "MixerState":
        return MixerState({k: v.repeat_interleave(repeats, 0) for k, v in self.rows.items()}, dict(self.shared))

    def copy_from(self, other: "MixerState") -> None:
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            if mine is not theirs:  # a step that wrote a buffer in place hands the same tensor back
                mine.copy_(theirs)
