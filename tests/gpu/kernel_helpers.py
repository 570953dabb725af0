"""Shared checks for the GPU kernel tests: float64 references and error bounds relative to PyTorch."""

from __future__ import annotations

import zlib

import pytest
import torch

from bem.kernels import custom_ops, ops, reference

fused_gemm = pytest.mark.skipif(
    not ops.KERNELS_AVAILABLE or not custom_ops._C.fused_gemm_available(),
    reason="the GEMM with the update inside needs a compute capability 9.0 GPU and an sm_90a build",
)


def conv1d_layout(W: torch.Tensor) -> torch.Tensor:
    """W (N, K) as GPT-2's Conv1D holds it: the transposed view of a row-major (K, N) tensor."""
    view = W.t().contiguous().t()
    assert not view.is_contiguous() or min(W.shape) == 1
    return view


def stable_seed(*parts) -> int:
    """A seed from the test's parameters that is the same in every run (Python's hash() of strings is
    salted per process, which made the drawn inputs, and so the outcome, change from run to run)."""
    return zlib.crc32(repr(parts).encode()) % 10_000


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64; NaN or inf anywhere gives inf, so it never passes."""
    out64 = out.detach().double()
    if not torch.isfinite(out64).all():
        return float("inf")
    return ((out64 - ref).norm() / ref.norm().clamp_min(1e-300)).item()


def bound(torch_err: float, dtype: torch.dtype) -> float:
    """The kernel may err at most 2x what plain PyTorch errs in the same dtype. The floor is one
    rounding of the output to the dtype (unit roundoff eps/2): with a handful of output elements,
    PyTorch's error can fall below that by luck of rounding, which no implementation can promise."""
    return 2.0 * max(torch_err, torch.finfo(dtype).eps / 2)


def poison_allocator(device: torch.device, numel: int) -> None:
    """Fill freed cached blocks with NaN so outputs the op allocates start as NaN, not stale numbers."""
    junk = torch.full((numel * 4 + 4096,), float("nan"), device=device, dtype=torch.float32)
    del junk


def operands(M: int, K: int, N: int, r: int, dtype: torch.dtype, codes: bool, seed: int, lead=None):
    g = torch.Generator(device="cuda").manual_seed(seed)
    shape = (M,) if lead is None else lead
    x = torch.randn(*shape, K, device="cuda", generator=g).to(dtype)
    V = (torch.randn(K, r, device="cuda", generator=g) / K**0.5).to(dtype)
    U = torch.randn(N, r, device="cuda", generator=g).to(dtype)
    c = (1 + 0.5 * torch.randn(*shape, r, device="cuda", generator=g)).to(dtype) if codes else None
    W = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    return x, W, b, V, c, U


def update_ref64(x, V, c, U, s):
    return reference.generated_update(x.double(), V.double(), None if c is None else c.double(), U.double(), s)


def linear_ref64(x, W, b, V, c, U, s):
    return reference.bem_linear(
        x.double(), W.double(), None if b is None else b.double(), V.double(),
        None if c is None else c.double(), U.double(), s,
    )
