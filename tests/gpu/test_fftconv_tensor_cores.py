"""The tensor-core kernel of fftconv (bfloat16 rows, L <= 8192, compute capability 9.0 and later) against float64:
that it is the kernel that runs, every spectrum length and radix of its plan, odd batches (a pair's second row
absent), heads split into chunks of pairs, rows and filters of very different magnitudes (its per-row and
per-filter scales into float16's range), the block kernels it replaces (BEM_FFTCONV_TENSOR_CORES=0) on the
same operands, and the backward's gradients it computes without an activation pass: du as a correlation (no
pre-gate), dk as Re IFFT(Zg conj(Zv)) over pairs of batch rows."""

from __future__ import annotations

import pytest
import torch

from bem.kernels.fftconv import custom_ops, dispatch, reference

from .kernel_helpers import bound, poison_allocator, rel_err, stable_seed
from .test_fftconv import _dD_floor, _operands, _reference64

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or custom_ops.extension() is None,
                       reason="needs a CUDA GPU and the fftconv kernels"),
    pytest.mark.skipif(torch.cuda.is_available() and torch.cuda.get_device_capability()[0] < 9,
                       reason="the tensor-core forward needs compute capability 9.0 or later"),
]

BF16 = torch.bfloat16


def _cuda_kernels(fn) -> list[str]:
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    return [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]


CASES = [
    # (B, H, L, Lk): spectrum lengths 1024 (radix 8, two radix-16 passes), 2048 (no radix-r pass), 4096 (radix 2),
    # 8192 (radix 4); odd B; one head with many pairs (chunks)
    (2, 3, 1, 1), (3, 5, 700, 300), (8, 7, 1024, 1024), (1, 4, 1500, 2000), (5, 3, 2048, 2048), (4, 6, 3000, 3000),
    (2, 768, 4096, 1000), (3, 2, 5000, 5000), (8, 3, 8192, 8192), (64, 1, 2000, 2000), (7, 9, 8191, 40),
]


@pytest.mark.parametrize("B,H,L,Lk", CASES)
def test_tensor_core_forward_within_twice_pytorchs_error(B, H, L, Lk):
    extras = (B + H + L) % 2 == 0
    u, k, D, pre, post = _operands(B, H, L, Lk, BF16, stable_seed("tc", B, H, L), gates=extras, D=True)
    ref = _reference64(u, k, D, pre, post, extras)
    torch_err = rel_err(reference.fftconv_fft(u, k, D, pre, post, extras), ref)
    poison_allocator(u.device, u.numel())
    y = None

    def run():
        nonlocal y
        y = dispatch.fftconv(u, k, D, pre, post, gelu=extras)

    names = _cuda_kernels(run)
    assert any("tc_forward_kernel" in n for n in names), sorted(set(names))
    err = rel_err(y, ref)
    assert err <= bound(torch_err, BF16), f"error {err:.3g}, PyTorch's {torch_err:.3g}"


def test_block_kernels_still_run_when_switched_off(monkeypatch):
    u, k, D, pre, post = _operands(3, 5, 3000, 3000, BF16, seed=5)
    ref = _reference64(u, k, D, pre, post, True)
    torch_err = rel_err(reference.fftconv_fft(u, k, D, pre, post, True), ref)
    monkeypatch.setenv("BEM_FFTCONV_TENSOR_CORES", "0")
    names = _cuda_kernels(lambda: dispatch.fftconv(u, k, D, pre, post, gelu=True))
    assert not any("tc_forward_kernel" in n for n in names), sorted(set(names))
    assert rel_err(dispatch.fftconv(u, k, D, pre, post, gelu=True), ref) <= bound(torch_err, BF16)


@pytest.mark.parametrize("dtype", [torch.float16, torch.float32], ids=str)
def test_other_dtypes_keep_the_block_kernels(dtype):
    u, k, D, _, _ = _operands(2, 3, 3000, 3000, dtype, seed=6, gates=False)
    names = _cuda_kernels(lambda: dispatch.fftconv(u, k, D))
    assert not any("tc_forward_kernel" in n for n in names), sorted(set(names))


@pytest.mark.parametrize("L", [1000, 8192])
def test_rows_and_filters_of_very_different_magnitudes(L):
    # each row is scaled into float16's range on its own, so a pair of rows 1e8 apart keeps each row's accuracy;
    # so does a filter of 1e6 (its spectrum's scale) and values past float16's range
    u, k, D, pre, post = _operands(4, 3, L, L, BF16, seed=7, gates=False)
    scales = torch.tensor([1e4, 1e-4, 3e20, 1.0], device="cuda").view(4, 1, 1)
    u = (u.float() * scales).to(BF16)
    k = (k.float() * torch.tensor([1e6, 1.0, 1e-6], device="cuda").view(3, 1)).to(BF16)
    ref = _reference64(u, k, D, None, None, False)
    y = dispatch.fftconv(u, k, D)
    theirs = reference.fftconv_fft(u, k, D)
    for b in range(4):
        for h in range(3):
            err, torch_err = rel_err(y[b, h], ref[b, h]), rel_err(theirs[b, h], ref[b, h])
            assert err <= bound(torch_err, BF16), (b, h, err, torch_err)


def test_equal_inputs_give_equal_rows():
    # the two rows of a pair share one transform: the same row in both parts comes out the same in both
    u, k, D, _, _ = _operands(1, 5, 4000, 4000, BF16, seed=8, gates=False)
    y = dispatch.fftconv(u.expand(2, 5, 4000).contiguous(), k, D)
    assert torch.isfinite(y).all()
    ref = _reference64(u, k, D, None, None, False)[0]
    for b in range(2):
        assert rel_err(y[b], ref) <= bound(rel_err(reference.fftconv_fft(u, k, D)[0], ref), BF16)


def _grads_of_leaves(fn, operands, grad_y):
    leaves = [t for t in operands if t is not None and t.requires_grad]
    return leaves, torch.autograd.grad(fn(*operands), leaves, grad_y)


# (B, H, L, Lk, k's dtype, pre-gate, post-gate, D): one chunk of pairs a head (dk written by the kernel, in k's
# dtype, zero past L where the filter is longer) and several (shares summed after); an odd B (a pair of one row);
# every gate with its gradient, the Hyena mixer's operands (a post-gate, D) among them
@pytest.mark.parametrize("B,H,L,Lk,k_dtype,pre,post,with_D", [
    (3, 5, 1000, 1500, BF16, False, False, True), (4, 2, 3000, 700, torch.float32, False, True, True),
    (6, 768, 4096, 4096, BF16, False, True, True), (5, 3, 2000, 2000, BF16, True, True, True),
    (5, 3, 8192, 8192, torch.float32, False, True, False), (8, 4, 8192, 8192, BF16, True, False, True)])
def test_backward_on_tensor_cores(B, H, L, Lk, k_dtype, pre, post, with_D):
    u, k, D, pregate, postgate = _operands(B, H, L, Lk, BF16, stable_seed("tc-bwd", B, H, L, Lk), gates=True,
                                           D=with_D, requires_grad=True)
    k = k.detach().to(k_dtype).requires_grad_()
    operands = [u, k, D, pregate if pre else None, postgate if post else None]
    grad_y = torch.randn(B, H, L, device="cuda", dtype=torch.float64).to(BF16)
    exact64 = [None if t is None else t.detach().double().requires_grad_(t.requires_grad) for t in operands]
    _, ref = _grads_of_leaves(reference.fftconv_fft, exact64, grad_y.double())
    _, pytorch = _grads_of_leaves(reference.fftconv_fft, operands, grad_y)
    poison_allocator(grad_y.device, 4 * grad_y.numel())
    ours = None

    def run():
        nonlocal ours
        _, ours = _grads_of_leaves(dispatch.fftconv, operands, grad_y)

    names = _cuda_kernels(run)
    # the forward, du, dpregate and dpostgate each one launch of the tensor-core kernel; dk (and dD) another
    assert sum("tc_forward_kernel" in n for n in names) == 2 + pre + post, sorted(set(names))
    assert sum("tc_filter_grad_kernel" in n for n in names) == 1, sorted(set(names))
    assert not any("backward_kernel" in n or "dD_parts" in n for n in names), sorted(set(names))
    labels = [n for n, t in zip(("du", "dk", "dD", "dpregate", "dpostgate"), operands)
              if t is not None and t.requires_grad]
    leaves = [t for t in operands if t is not None and t.requires_grad]
    assert len(ours) == len(leaves)
    for name, mine, theirs, exact, leaf in zip(labels, ours, pytorch, ref, leaves):
        assert mine.dtype == leaf.dtype and mine.shape == leaf.shape, name
        err, torch_err = rel_err(mine, exact), rel_err(theirs, exact)
        floor = _dD_floor(operands, grad_y, False, exact) if name == "dD" else 0.0
        assert err <= bound(max(torch_err, floor), BF16), f"{name}: error {err:.3g}, PyTorch's {torch_err:.3g}"


def test_backward_with_gelu_keeps_the_block_kernels():
    # GELU's derivative needs the pre-activation's rows: the block kernels' activation pass
    u, k, D, pregate, postgate = _operands(2, 3, 2000, 2000, BF16, seed=11, gates=True, requires_grad=True)
    names = _cuda_kernels(lambda: torch.autograd.grad(dispatch.fftconv(u, k, D, pregate, postgate, gelu=True).sum(),
                                                      (u, k, D, pregate, postgate)))
    assert any("backward_kernel" in n for n in names) and not any("tc_filter_grad" in n for n in names), names
