"""The single dispatch point between the fused CUDA kernels and the PyTorch reference.

Modules call `generated_update` / `bem_linear` here and never choose a backend themselves.
"""

from __future__ import annotations

from typing import Optional

import torch

from . import reference

# Set once the CUDA extension is built and loaded; until then every call takes the reference path.
KERNELS_AVAILABLE = False


def _check_update_args(x: torch.Tensor, V: torch.Tensor, codes: Optional[torch.Tensor], U: torch.Tensor) -> None:
    if V.dim() != 2 or U.dim() != 2:
        raise ValueError(f"V and U must be 2-D (K x r, N x r); got V {tuple(V.shape)}, U {tuple(U.shape)}")
    K, r = V.shape
    if U.shape[1] != r:
        raise ValueError(f"rank mismatch: V is {tuple(V.shape)} (K x r) but U is {tuple(U.shape)} (N x r)")
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features in its last dimension, V expects K={K}")
    if codes is not None and tuple(codes.shape) != tuple(x.shape[:-1]) + (r,):
        raise ValueError(
            f"codes must have shape {tuple(x.shape[:-1]) + (r,)} (input's leading dims + rank); "
            f"got {tuple(codes.shape)}"
        )


def generated_update(
    x: torch.Tensor,
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
    use_fused: bool = True,
) -> torch.Tensor:
    """`s * ((x V) ⊙ codes) U^T`; codes None means all ones (plain LoRA)."""
    _check_update_args(x, V, codes, U)
    return reference.generated_update(x, V, codes, U, scaling)


def bem_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
    use_fused: bool = True,
) -> torch.Tensor:
    """`x W^T + b + s * ((x V) ⊙ codes) U^T`, W: (N, K)."""
    _check_update_args(x, V, codes, U)
    if weight.shape != (U.shape[0], V.shape[0]):
        raise ValueError(
            f"weight must be (N, K) = ({U.shape[0]}, {V.shape[0]}) to match U and V; got {tuple(weight.shape)}"
        )
    return reference.bem_linear(x, weight, bias, V, codes, U, scaling)
