"""The fused GEMM (linear modes 6 and 7, `gemm_update_given`) against a float64 reference, error at most 2x
PyTorch's in the same dtype, with row-major and Conv1D-layout weights; where the default dispatch takes it."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import custom_ops, ops, reference

from .kernel_helpers import (bound, conv1d_layout, fused_gemm, linear_ref64, operands, poison_allocator, rel_err,
                             stable_seed)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


@fused_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M,K,N,r,codes,bias",
    [(1, 8, 8, 8, False, False), (129, 64, 136, 16, True, False), (1000, 776, 904, 8, True, True),
     (777, 768, 768, 64, False, True), (300, 2056, 1032, 40, True, True), (5000, 768, 776, 24, True, True),
     (6000, 3072, 768, 32, True, True), (515, 1032, 1160, 56, True, True)],
)
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("mode", [6, 7])
@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_with_the_update_inside_matches_float64(dtype, M, K, N, r, codes, bias, tile_n, mode, transposed):
    """Linear modes 6 (P computed inside) and 7 (s P ⊙ codes from cuBLAS and the scaling kernel first)
    with 128- and 256-column tiles, W row-major or the transposed view of a row-major (K, N) tensor
    (GPT-2's Conv1D): odd M, N not a multiple of 128 or 256, K not a multiple of 64, ranks padded to
    8..64, with and without codes and bias, several tiles per block (M = 5000 and 6000); P comes out too."""
    seed = stable_seed(M, K, N, r, str(dtype), transposed)
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=codes, seed=seed)
    if transposed:
        W = conv1d_layout(W)
    b = b if bias else None
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * N + M * r)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode, gemm_tile_n=tile_n)
    assert rel_err(y, ref) <= bound(torch_err, dtype)
    assert P.dtype == torch.float32 and rel_err(P, x.double() @ V.double()) < 1e-5
    y2, P2 = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode, 0, False, gemm_tile_n=tile_n)
    assert P2 is None and torch.equal(y, y2)


@fused_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(
    "M,K,N,r,bias",
    [(1, 8, 8, 8, False), (129, 64, 136, 16, False), (1000, 776, 904, 8, True), (777, 768, 768, 64, True),
     (300, 2056, 1032, 40, False), (5000, 768, 776, 24, True), (515, 1032, 1160, 56, True)],
)
@pytest.mark.parametrize("tile_n", [128, 256])
@pytest.mark.parametrize("transposed", [False, True])
def test_gemm_given_the_projection_matches_float64(dtype, M, K, N, r, bias, tile_n, transposed):
    """`gemm_update_given`: Y = x W^T + b + Pc U^T from the fused GEMM, with W row-major or read transposed
    (the transposed view of a row-major (K, N) tensor: GPT-2's Conv1D, and W^T in the backward's
    dX = dY W), 128- and 256-column tiles; odd M, N not a multiple of 64, K not a multiple of 64, several
    tiles per block (M = 5000). With a transposed weight, linear mode 7 takes it too."""
    seed = stable_seed(M, K, N, r, str(dtype), transposed)
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=True, seed=seed)
    if transposed:
        W = conv1d_layout(W)
    b = b if bias else None
    Pc = (0.5 * torch.randn(M, r, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed))).to(dtype)
    ref = x.double() @ W.double().t() + Pc.double() @ U.double().t() + (0 if b is None else b.double())
    torch_err = rel_err(torch.nn.functional.linear(x, W, b) + Pc @ U.t(), ref)
    poison_allocator(x.device, M * N)
    y = custom_ops._C.gemm_update_given(x, W, b, Pc, U, tile_n)
    assert y.shape == (M, N) and rel_err(y, ref) <= bound(torch_err, dtype)
    if transposed:
        ref = linear_ref64(x, W, b, V, c, U, 1.5)
        poison_allocator(x.device, M * N + M * r)
        y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 7, gemm_tile_n=tile_n)
        assert rel_err(y, ref) <= bound(rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref), dtype)
        assert P.dtype == torch.float32 and rel_err(P, x.double() @ V.double()) < 1e-5


@fused_gemm
def test_gemm_with_the_update_inside_is_the_default_where_it_measured_faster():
    """Where its tiles fill at least half the GPU and K x N is small for the rank, the default dispatch is
    linear mode 6 (bit-equal): 768² at r = 16, 4096² at r = 8, and with 128-column tiles 2048² at r = 8
    and 1024 rows (128 tiles). Up to r = 32 it is also the default for calls short enough that the host is
    their bound (up to 2048 rows and M K N <= 2^34): 768² at 1024 rows (24 tiles) and r = 16, 2048² at 512
    rows (64 tiles), 576² and 8192 x 2048 at 1024 rows; not 4096² at 2048 rows and r = 32 or 8192 x 3072 at
    1024 rows (M K N above 2^34), 768² at 2049 rows and r = 16, or 768² at 1024 rows and r = 64."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for M, K, N, r, expected in ((128 * sms // 3 + 129, 768, 768, 16, True), (1024, 768, 768, 16, True),
                                 (128 * sms // 32 + 200, 4096, 4096, 8, True), (2048, 4096, 4096, 32, False),
                                 (1024, 2048, 2048, 8, True), (1024, 2048, 2048, 16, True),
                                 (512, 2048, 2048, 8, True), (1024, 576, 576, 8, True), (1024, 8192, 2048, 8, True),
                                 (1024, 8192, 3072, 8, False), (2049, 768, 768, 16, False),
                                 (1024, 768, 768, 64, False)):
        x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=7)
        auto, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 0)
        fused, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 6)
        other, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3)
        assert not torch.equal(fused, other)
        assert torch.equal(auto, fused if expected else other), f"M = {M}, K = {K}, N = {N}, r = {r}"


@fused_gemm
def test_gemm_given_the_projection_is_the_default_at_a_few_hundred_rows_from_rank_32():
    """From 512 to 1023 rows at r >= 32, where mode 6 does not suit by device time, the default is linear
    mode 7 (bit-equal, and within the float64 bound): 4096² at r = 32 and 64, 2048 x 8192 at r = 32. Not at
    511 or 1024 rows, nor at r = 16: there these calls are short enough for the host to be their bound, and
    the default is the one launch of mode 6 (mode 3 at r = 64 and 1024 rows)."""
    for M, K, N, r, expected in ((512, 4096, 4096, 32, 7), (1023, 4096, 4096, 64, 7), (700, 2048, 8192, 32, 7),
                                 (511, 4096, 4096, 32, 6), (1024, 4096, 4096, 32, 6), (600, 4096, 4096, 16, 6),
                                 (1024, 4096, 4096, 64, 3)):
        x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r))
        auto, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 0)
        chosen, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, expected)
        other, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3 if expected == 7 else 7)
        assert not torch.equal(chosen, other)
        assert torch.equal(auto, chosen), f"M = {M}, K = {K}, N = {N}, r = {r}"
        if expected == 7:
            ref = linear_ref64(x, W, b, V, c, U, 1.5)
            assert rel_err(auto, ref) <= bound(rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref),
                                               torch.bfloat16)


@fused_gemm
def test_conv1d_weights_take_the_fused_gemm_where_row_major_ones_do():
    """Weights stored as GPT-2's Conv1D stores them (a row-major (K, N) tensor read transposed) get the same
    default as row-major ones (bit-equal to the forced mode): mode 6 where the tiles fill the GPU and K x N
    is small for the rank, mode 7 at a few hundred rows from rank 32 where the 128-column tiles fill half
    of it, mode 6 again where they do not but the call is short (3072 x 768 at 700 rows and r = 32: 36
    tiles), mode 3 where neither holds (the same at r = 64), for either layout."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    cases = [(128 * sms // 3 + 129, 768, 768, 16, 6, True), (700, 768, 3072, 32, 7, True),
             (700, 3072, 768, 32, 6, True), (700, 3072, 768, 32, 6, False), (700, 3072, 768, 64, 3, True),
             (700, 3072, 768, 64, 3, False), (4096, 1024, 4096, 8, 6, True)]
    for M, K, N, r, expected, conv1d in cases:
        x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r, conv1d))
        if conv1d:
            W = conv1d_layout(W)
        auto, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 0)
        chosen, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, expected)
        other, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3 if expected != 3 else 7)
        assert not torch.equal(chosen, other)
        assert torch.equal(auto, chosen), f"M = {M}, K = {K}, N = {N}, r = {r}, Conv1D layout: {conv1d}"
        ref = linear_ref64(x, W, b, V, c, U, 1.5)
        assert rel_err(auto, ref) <= bound(rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref), torch.bfloat16)
