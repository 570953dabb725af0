"""The fused linear under eager autograd, straight onto the extension.

In an eager training step of a small or narrow model each wrapped linear is bound by host time, and the
custom op's dispatch (`custom_ops.fused_bem_linear`: the dispatcher, its autograd wrapper, the Python
implementation) cost more of it than the kernels take on the device. `FusedLinear` is a plain
`torch.autograd.Function` over the same extension calls: the same kernels and the same backward
(`custom_ops.lowrank_backward`), so the same numbers. `torch.compile` never sees it: traced code takes the
custom ops (`ops.bem_linear` chooses).
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import custom_ops


class FusedLinear(torch.autograd.Function):
    """y = x W^T + b + s ((x V) ⊙ codes) U^T for x (..., K) and codes (..., r), both row-major; W and b frozen.
    The extension refuses with ValueError, before anything runs, operands it does not take as they are."""

    @staticmethod
    def forward(ctx, x: Tensor, weight: Tensor, bias: Optional[Tensor], V: Tensor, codes: Optional[Tensor],
                U: Tensor, scaling: float) -> Tensor:
        # positional (mode 0: by shape; split 0: by shape; no x V: the backward recomputes it from x, so that
        # a training step holds what LoRA's holds, x and an (M, r) tensor, the codes)
        y, _ = custom_ops._C.linear_forward(x, weight, bias, V, codes, U, scaling, 0, 0, False, None)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(x, weight, V, codes, U)
        ctx.scaling = scaling
        return y

    @staticmethod
    def backward(ctx, grad_y: Optional[Tensor]):
        if grad_y is None:
            return None, None, None, None, None, None, None
        x, weight, V, codes, U = ctx.saved_tensors
        n = ctx.needs_input_grad
        rows = x.numel() // x.shape[-1]
        dy = grad_y.reshape(rows, grad_y.shape[-1]).contiguous()
        x2 = x.reshape(rows, x.shape[-1])
        codes2 = None if codes is None else codes.reshape(rows, codes.shape[-1])
        dx, dv, dcodes, du = custom_ops.lowrank_backward(dy, x2, V, codes2, U, None, ctx.scaling, weight,
                                                         (n[0], n[3], n[4], n[5]), direct=True)
        dx = None if dx is None else dx.view(x.shape)
        dcodes = None if dcodes is None else dcodes.view(codes.shape)
        return dx, None, None, dv, dcodes, du, None
