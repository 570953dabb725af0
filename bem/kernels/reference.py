"""PyTorch reference for every BEM kernel.

This is the CPU path, the fallback when the CUDA extension is missing, and the oracle the kernel
tests compare against. It is written for clarity; the order of operations mirrors PEFT's LoRA
(`B(A(x)) * scaling`) so that a routing-off BEM reproduces LoRA's outputs.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F


def generated_update(
    x: torch.Tensor,
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`s * ((x V) ⊙ codes) U^T`.

    x: (..., K), V: (K, r), codes: (..., r) or None (all ones), U: (N, r) -> (..., N).
    """
    low_rank = x @ V
    if codes is not None:
        low_rank = low_rank * codes
    return (low_rank @ U.t()) * scaling


def bem_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
) -> torch.Tensor:
    """`x W^T + b + s * ((x V) ⊙ codes) U^T` with W: (N, K) as in `nn.Linear`."""
    return F.linear(x, weight, bias) + generated_update(x, V, codes, U, scaling)
