"""A module trained beside the BEM modules (`modules_to_save`, as in PEFT), such as a classification head:
a trainable copy runs while BEM is enabled and the frozen original while it is disabled, so that
`disable_bem()` stays the exact base model and `unload()` gives the original back."""

from __future__ import annotations

import copy
from typing import Any

import torch.nn as nn

from .bem_linear import RoutingContext


class TrainableCopy(nn.Module):
    def __init__(self, original: nn.Module, context: RoutingContext) -> None:
        super().__init__()
        self.original = original
        self.trained = copy.deepcopy(original)
        self.trained.requires_grad_(True)
        self.context = context

    def forward(self, *args: Any, **kwargs: Any) -> Any:
        return (self.trained if self.context.enabled else self.original)(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        try:
            return super().__getattr__(name)
        except AttributeError:
            if name in ("original", "trained"):
                raise
            return getattr(self.trained, name)  # e.g. a head's weight, read by the model's own code
