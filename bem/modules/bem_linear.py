"""`BEMLinear`: a frozen linear (or GPT-2 `Conv1D`) plus a code-modulated low-rank update.

    y = base_layer(x) + s * ((dropout(x) V) ⊙ c_t) U^T,   s = alpha / rank

The codes `c_t` for this module are read from a `RoutingContext` shared with the controller;
the update itself goes through `bem.kernels.ops`, the single kernel/reference dispatch point.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn
from transformers.pytorch_utils import Conv1D

from ..kernels import ops


class RoutingContext:
    """Per-model scratch space shared by the controller and every `BEMLinear`.

    `codes` holds the current forward's codes as (num_modules, *leading_dims, rank); `None` means
    routing is off (every code is one). `enabled` False makes every wrapped layer its bare base.
    """

    def __init__(self) -> None:
        self.enabled: bool = True
        self.codes: Optional[torch.Tensor] = None

    def codes_for(self, index: int) -> Optional[torch.Tensor]:
        return None if self.codes is None else self.codes[index]


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """(in_features K, out_features N) of an `nn.Linear` or `Conv1D`."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        return layer.weight.shape[0], layer.weight.shape[1]
    raise TypeError(f"BEM wraps nn.Linear and transformers Conv1D layers, not {type(layer).__name__}")


class BEMLinear(nn.Module):
    """Wraps a frozen `base_layer`; only `bem_V` (K x r) and `bem_U` (N x r) are trainable."""

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float,
        module_index: int,
        context: RoutingContext,
        use_fused_kernels: bool = True,
        name: str = "",
    ) -> None:
        super().__init__()
        in_features, out_features = linear_features(base_layer)
        self.base_layer = base_layer
        self.in_features, self.out_features = in_features, out_features
        self.rank = rank
        self.scaling = alpha / rank
        self.module_index = module_index
        self.use_fused_kernels = use_fused_kernels
        self.name = name
        self.context = context
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = base_layer.weight
        factory = {"device": weight.device, "dtype": weight.dtype}
        self.bem_V = nn.Parameter(torch.empty(in_features, rank, **factory))
        self.bem_U = nn.Parameter(torch.zeros(out_features, rank, **factory))
        self.reset_bem_parameters()

    def reset_bem_parameters(self) -> None:
        # V^T plays LoRA's A (r x K): Kaiming-uniform as LoRA initialises A; U = 0 keeps the base exact.
        lora_a = torch.empty(self.rank, self.in_features, device=self.bem_V.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
        with torch.no_grad():
            self.bem_V.copy_(lora_a.t())
            self.bem_U.zero_()

    def _weight_nk(self) -> torch.Tensor:
        """The frozen weight as (N, K); a transposed view for Conv1D (no copy)."""
        weight = self.base_layer.weight
        return weight.t() if isinstance(self.base_layer, Conv1D) else weight

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.context.enabled:
            return self.base_layer(x)
        codes = self._codes_like(x)
        x_adapter = x.to(self.bem_V.dtype)
        if codes is not None:
            codes = codes.to(self.bem_V.dtype)
        if isinstance(self.dropout, nn.Dropout) and self.training:
            update = ops.generated_update(
                self.dropout(x_adapter), self.bem_V, codes, self.bem_U, self.scaling, self.use_fused_kernels
            )
            return self.base_layer(x) + update.to(x.dtype)
        if x.dtype != self.bem_V.dtype or torch.is_autocast_enabled(x.device.type):
            # mixed dtypes: run the frozen layer as the user configured it, add the update on top
            update = ops.generated_update(x_adapter, self.bem_V, codes, self.bem_U, self.scaling, self.use_fused_kernels)
            return self.base_layer(x) + update.to(x.dtype)
        return ops.bem_linear(
            x, self._weight_nk(), self.base_layer.bias, self.bem_V, codes, self.bem_U, self.scaling,
            self.use_fused_kernels,
        )

    def _codes_like(self, x: torch.Tensor) -> Optional[torch.Tensor]:
        codes = self.context.codes_for(self.module_index)
        if codes is None:
            return None
        leading = x.shape[:-1]
        if codes.shape[:-1] == leading:
            return codes
        if codes.shape[:-1].numel() == leading.numel():
            return codes.reshape(*leading, self.rank)
        raise ValueError(
            f"BEM module '{self.name}' got an input of shape {tuple(x.shape)} but the controller produced "
            f"codes for {tuple(codes.shape[:-1])} token positions; the model must feed this layer the "
            f"tokens that entered the first block"
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"
