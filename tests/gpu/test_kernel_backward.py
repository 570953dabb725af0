"""Backward of the fused ops: float64 gradcheck, and bf16/fp16/fp32 gradients against float64."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import ops, reference

from .kernel_helpers import bound, operands, rel_err

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


@pytest.mark.parametrize("with_codes", [True, False])
def test_gradcheck_float64(with_codes):
    x, W, b, V, c, U = operands(5, 11, 7, 3, torch.float64, codes=with_codes, seed=1)
    leaves = [t.requires_grad_() for t in (x, V, U)] + ([c.requires_grad_()] if with_codes else [])

    def update(x, V, U, *codes):
        return ops.generated_update(x, V, codes[0] if codes else None, U, 0.5)

    def linear(x, V, U, *codes):
        return ops.bem_linear(x, W.t().contiguous().t(), b, V, codes[0] if codes else None, U, 0.5)

    assert torch.autograd.gradcheck(update, leaves)
    assert torch.autograd.gradcheck(linear, leaves)


def _grads(fn, tensors):
    for t in tensors:
        t.grad = None
    out = fn(*tensors)
    g = torch.Generator(device="cuda").manual_seed(7)
    out.backward(torch.randn(out.shape, device="cuda", generator=g).to(out.dtype))
    return [t.grad for t in tensors]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("M,K,N,r", [(1, 64, 48, 8), (17, 129, 77, 13), (64, 512, 256, 32), (300, 1000, 515, 64)])
@pytest.mark.parametrize("op", ["update", "linear"])
def test_gradients_match_float64(dtype, M, K, N, r, op):
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=True, seed=M + r)
    leaves = [t.detach().requires_grad_() for t in (x, V, c, U)]

    def make(module, w, bias):
        if op == "update":
            return lambda x, V, c, U: module.generated_update(x, V, c, U, 1.3)
        return lambda x, V, c, U: module.bem_linear(x, w, bias, V, c, U, 1.3)

    ref_leaves = [t.detach().double().requires_grad_() for t in leaves]
    ref_grads = _grads(make(reference, W.double(), b.double()), ref_leaves)
    torch_grads = _grads(make(reference, W, b), leaves)
    kernel_grads = _grads(make(ops, W, b), leaves)
    for name, k, t, ref in zip(("x", "V", "codes", "U"), kernel_grads, torch_grads, ref_grads):
        torch_err = rel_err(t, ref)
        assert rel_err(k, ref) <= bound(torch_err, dtype), f"d{name}: {rel_err(k, ref):.3g} vs torch {torch_err:.3g}"


def test_frozen_weight_gets_no_gradient_and_codes_none_is_lora():
    x, W, b, V, _, U = operands(9, 64, 32, 8, torch.bfloat16, codes=False, seed=2)
    x.requires_grad_()
    V.requires_grad_()
    U.requires_grad_()
    ops.bem_linear(x, W, b, V, None, U, 2.0).float().sum().backward()
    assert W.grad is None and x.grad is not None and V.grad is not None and U.grad is not None
