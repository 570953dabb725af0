"""Fused forward kernels against a float64 reference, error at most 2x PyTorch's in the same dtype."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import custom_ops, ops, reference

from .kernel_helpers import (bound, conv1d_layout, fused_gemm, linear_ref64, operands, poison_allocator, rel_err,
                             stable_seed, update_ref64)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]
needs_clusters = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="thread-block clusters need a compute capability 9.0 GPU")
DTYPES = [torch.bfloat16, torch.float16, torch.float32]
# (M, K, N): odd sizes, unaligned rows, one-row inputs, a tile boundary plus one
SHAPES = [(1, 7, 5), (3, 64, 130), (37, 129, 77), (33, 256, 129), (65, 520, 264), (300, 1000, 515)]
RANKS = [1, 8, 13, 16, 32, 64, 100, 128]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES)
@pytest.mark.parametrize("r", RANKS)
def test_generated_update_matches_float64(dtype, M, K, N, r):
    seed = stable_seed(M, K, N, r, str(dtype))
    x, _, _, V, c, U = operands(M, K, N, r, dtype, codes=r % 2 == 0, seed=seed)
    ref = update_ref64(x, V, c, U, 0.7)
    torch_err = rel_err(reference.generated_update(x, V, c, U, 0.7), ref)
    poison_allocator(x.device, M * N)
    out = ops.generated_update(x, V, c, U, 0.7)
    assert out.dtype == dtype and out.shape == (M, N)
    err = rel_err(out, ref)
    assert err <= bound(torch_err, dtype), f"kernel {err:.3g} vs torch {torch_err:.3g}"


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,K,N", SHAPES + [(16, 4096, 4096), (64, 1024, 3000)])
@pytest.mark.parametrize("r", [1, 8, 24, 64, 128])
@pytest.mark.parametrize("transposed", [False, True])
def test_bem_linear_matches_float64(dtype, M, K, N, r, transposed):
    seed = stable_seed(M, K, N, r, transposed, str(dtype))
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=True, seed=seed)
    if transposed:  # GPT-2 Conv1D stores (K, N); the caller passes the (N, K) view
        W = conv1d_layout(W)
    bias = b if r != 24 else None
    ref = linear_ref64(x, W, bias, V, c, U, 2.0)
    torch_err = rel_err(reference.bem_linear(x, W, bias, V, c, U, 2.0), ref)
    poison_allocator(x.device, M * N)
    out = ops.bem_linear(x, W, bias, V, c, U, 2.0)
    err = rel_err(out, ref)
    assert err <= bound(torch_err, dtype), f"kernel {err:.3g} vs torch {torch_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("mode", [1, 2, 3, 4, 5])
@pytest.mark.parametrize("M", [1, 16, 64])
def test_every_linear_mode_agrees(dtype, mode, M):
    """Both decode kernels and the three GEMM + update compositions compute the same function."""
    x, W, b, V, c, U = operands(M, 768, 1000, 16, dtype, codes=True, seed=M * 10 + mode)
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * 1000)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode)
    assert rel_err(y, ref) <= bound(torch_err, dtype)
    assert rel_err(P, x.double() @ V.double()) < 1e-2


@pytest.mark.parametrize("kernel", [1, 2, 3])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1, 64, 40), (37, 136, 77), (1000, 520, 264), (2053, 1024, 1000),
                                   (4096, 768, 768)])
@pytest.mark.parametrize("r", [1, 8, 13, 16, 24, 32, 40, 64])
def test_update_kernels_match_float64(kernel, dtype, M, K, N, r):
    """Every update path, forced (1: streaming kernel, for K and r multiples of 8; 2: tiles kernel;
    3: two cuBLAS GEMMs around the scaling kernel), x V too."""
    seed = stable_seed(M, K, N, r, kernel, str(dtype))
    x, _, _, V, c, U = operands(M, K, N, r, dtype, codes=r != 13, seed=seed)
    ref = update_ref64(x, V, c, U, 0.8)
    torch_err = rel_err(reference.generated_update(x, V, c, U, 0.8), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.update_forward(x, V, c, U, 0.8, kernel)
    err = rel_err(y, ref)
    assert err <= bound(torch_err, dtype), f"kernel {err:.3g} vs torch {torch_err:.3g}"
    assert rel_err(P, x.double() @ V.double()) < 1e-2


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("M,L,r", [(1, 64, 8), (37, 129, 13), (2053, 1024, 64), (4096, 768, 128)])
def test_projection_keeps_float32_sums(dtype, M, L, r):
    """The backward's dY U (lowrank_project): float32 output, summed in float32, never rounded to the
    operands' dtype (its error is that of float32 sums, far below one bf16 rounding)."""
    g = torch.Generator(device="cuda").manual_seed(stable_seed(M, L, r, str(dtype)))
    a = torch.randn(M, L, device="cuda", generator=g).to(dtype)
    b = torch.randn(L, r, device="cuda", generator=g).to(dtype)
    poison_allocator(a.device, M * r)
    out = custom_ops.lowrank_project(a, b)
    assert out.dtype == torch.float32 and out.shape == (M, r)
    assert rel_err(out, a.double() @ b.double()) < 1e-5


STREAM_SHAPES = [(1, 64, 40, 8), (75, 264, 77, 16), (1000, 520, 264, 24), (333, 1032, 1000, 32),
                 (2053, 1024, 1000, 40), (130, 512, 96, 64),
                 (9001, 72, 136, 16), (20011, 64, 72, 8)]  # more token groups than resident blocks: they loop


@pytest.mark.parametrize("tokens,M,K,N,r", [(t, *shape) for t in (16, 32, 64) for shape in STREAM_SHAPES
                                            if t < 64 or shape[3] <= 32])
def test_streaming_update_every_block_height(tokens, M, K, N, r):
    """The streaming kernel at 16, 32 and 64 tokens per block (64 takes ranks up to 32): partial groups,
    padded ranks, odd N, blocks that take several groups, and repeated calls bit-identical."""
    x, _, _, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r, tokens))
    ref = update_ref64(x, V, c, U, 0.8)
    torch_err = rel_err(reference.generated_update(x, V, c, U, 0.8), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.update_forward(x, V, c, U, 0.8, 1, tokens)
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert rel_err(P, x.double() @ V.double()) < 1e-2
    y2, P2 = custom_ops._C.update_forward(x, V, c, U, 0.8, 1, tokens)
    assert torch.equal(y, y2) and torch.equal(P, P2)


CLUSTER_SHAPES = [(17, 4096, 4096, 8), (75, 1000, 77, 16), (333, 1032, 1000, 32), (130, 512, 96, 64),
                  (517, 2056, 4104, 40), (1000, 264, 300, 24)]  # K slices and column tiles left empty too


@needs_clusters
@pytest.mark.parametrize("cluster", [1, 2, 4, 8])
@pytest.mark.parametrize("tokens", [16, 32])
@pytest.mark.parametrize("M,K,N,r", CLUSTER_SHAPES)
def test_streaming_update_on_a_cluster(cluster, tokens, M, K, N, r):
    """The streaming kernel with each group of tokens shared by a thread-block cluster (K split for x V,
    summed through distributed shared memory; N split for the expansion): every cluster size, uneven
    and empty slices, and repeated calls bit-identical (the cluster's sum has a fixed order)."""
    x, _, _, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r, cluster))
    ref = update_ref64(x, V, c, U, 0.8)
    torch_err = rel_err(reference.generated_update(x, V, c, U, 0.8), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.update_forward(x, V, c, U, 0.8, 1, tokens, cluster)
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert rel_err(P, x.double() @ V.double()) < 1e-2
    y2, P2 = custom_ops._C.update_forward(x, V, c, U, 0.8, 1, tokens, cluster)
    assert torch.equal(y, y2) and torch.equal(P, P2)


@needs_clusters
@pytest.mark.parametrize("M,K,N,r,clustered", [(200, 2048, 1000, 8, True), (200, 2048, 1000, 16, True),
                                               (1000, 1024, 520, 16, True), (200, 2048, 1000, 32, False),
                                               (200, 256, 1000, 8, False)])
def test_clustered_streaming_update_is_the_default_below_1024_rows(M, K, N, r, clustered):
    """Below 1024 rows the default update of linear mode 3 (cuBLAS and the update kernel: the default under
    CUDA-graph capture) takes the streaming kernel on clusters at ranks up to 16 (where at least two blocks
    of a cluster keep 256 columns of K each), the tiles kernel otherwise; the linear (which adds the bias in
    the update) matches float64 either way."""
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r, 7))
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * N)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    assert any("lowrank_stream_kernel" in name and "true>" in name for name in names) == clustered, names
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert rel_err(P, x.double() @ V.double()) < 1e-2


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("M,N,r", [(1100, 1000, 16), (2048, 517, 24), (200, 1000, 16), (45, 520, 64)])
def test_streaming_update_inside_the_linear(mode, M, N, r):
    """Prefill compositions where the streaming kernel runs by default (ranks 16-32, N >= K): bias in
    the update (mode 3) and accumulation into the GEMM output (mode 2), N not a multiple of 8 too."""
    x, W, b, V, c, U = operands(M, 512, N, r, torch.bfloat16, codes=True, seed=M + N + mode)
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode)
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert rel_err(P, x.double() @ V.double()) < 1e-2


@pytest.mark.parametrize("mode", [2, 3])
@pytest.mark.parametrize("M,N,r,codes", [(1100, 1000, 32, True), (2048, 517, 64, False), (1024, 264, 17, True)])
def test_two_gemm_update_inside_the_linear(mode, M, N, r, codes):
    """Prefill compositions where the update runs as two cuBLAS GEMMs (ranks above 16 from M = 1024):
    bias added with the update (mode 3), accumulation into the GEMM output (mode 2), no codes."""
    x, W, b, V, c, U = operands(M, 520, N, r, torch.bfloat16, codes=codes, seed=M + N + r + mode)
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode)
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert P.dtype == torch.float32 and rel_err(P, x.double() @ V.double()) < 1e-5


def test_leading_dims_and_non_contiguous_input():
    x, W, b, V, c, U = operands(6, 96, 80, 8, torch.bfloat16, codes=True, seed=3, lead=(2, 3, 5))
    x_nc = x.transpose(0, 1)  # (3, 2, 5, K), not contiguous
    c_nc = c.transpose(0, 1)
    ref = linear_ref64(x_nc, W, b, V, c_nc, U, 1.0)
    out = ops.bem_linear(x_nc, W, b, V, c_nc, U, 1.0)
    assert out.shape == (3, 2, 5, 80)
    assert rel_err(out, ref) <= bound(rel_err(reference.bem_linear(x_nc, W, b, V, c_nc, U, 1.0), ref), torch.bfloat16)


def test_autocast_runs_the_kernel_in_the_autocast_dtype():
    x, W, b, V, c, U = operands(40, 128, 96, 8, torch.float32, codes=True, seed=5)
    with torch.autocast("cuda", dtype=torch.bfloat16):
        out = ops.generated_update(x, V, c, U, 1.0)
    assert out.dtype == torch.bfloat16
    ref = update_ref64(x, V, c, U, 1.0)
    assert rel_err(out, ref) < 2e-2


TMA_SHAPES = [(1, 64, 40, 8), (37, 136, 72, 16), (1000, 520, 264, 24), (2053, 1032, 1000, 32),
              (333, 72, 136, 40), (4096, 768, 768, 64), (20011, 64, 72, 8), (130, 4096, 4104, 56)]


@fused_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", TMA_SHAPES)
@pytest.mark.parametrize("codes", [True, False])
def test_tma_update_matches_float64(dtype, M, K, N, r, codes):
    """Update kernel 4 (TMA in and out): a partial last tile of rows, K not a multiple of 64, N not a
    multiple of 128 or 64, ranks padded to 8..64, more tiles than multiprocessors (M = 20011: each block
    takes several and its two warpgroups pass them along); x V in float32; repeated calls bit-identical."""
    x, _, _, V, c, U = operands(M, K, N, r, dtype, codes=codes, seed=stable_seed(M, K, N, r, codes, str(dtype)))
    ref = update_ref64(x, V, c, U, 0.8)
    torch_err = rel_err(reference.generated_update(x, V, c, U, 0.8), ref)
    poison_allocator(x.device, M * N + M * r)
    y, P = custom_ops._C.update_forward(x, V, c, U, 0.8, 4)
    assert rel_err(y, ref) <= bound(torch_err, dtype)
    assert P.dtype == torch.float32 and rel_err(P, x.double() @ V.double()) < 1e-5
    y2, P2 = custom_ops._C.update_forward(x, V, c, U, 0.8, 4)
    assert torch.equal(y, y2) and torch.equal(P, P2)


def _tma_case(M, K, N, r):
    """The default update's profile: whether the TMA kernel ran, and the call's (Y, P)."""
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r))
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        auto = custom_ops._C.update_forward(x, V, c, U, 1.5)
        torch.cuda.synchronize()
    return any("lowrank_tma_kernel" in event.name for event in prof.events()), auto, (x, W, b, V, c, U)


@fused_gemm
def test_tma_update_is_the_default_where_it_measured_faster():
    """The default update takes the TMA kernel up to rank 16 once its 64-row tiles fill the GPU, and at rank
    8 from 2048 rows where N >= 2 K; not above rank 16, nor for a narrower or shorter call. The kernels can
    agree bit for bit (short sums of the same rounded s P ⊙ c), so the profile names the one that ran."""
    full = 64 * torch.cuda.get_device_properties(0).multi_processor_count + 5
    cases = ((full, 512, 264, 16, True), (2100, 256, 1000, 8, True), (full, 512, 264, 24, False),
             (2100, 512, 1000, 8, False), (2000, 256, 1000, 8, False), (2100, 256, 1000, 16, False))
    for M, K, N, r, expected in cases:
        ran, auto, (x, W, b, V, c, U) = _tma_case(M, K, N, r)
        assert ran == expected, f"M = {M}, K = {K}, N = {N}, r = {r}"
        if expected:
            forced = custom_ops._C.update_forward(x, V, c, U, 1.5, 4)
            assert torch.equal(auto[0], forced[0]) and torch.equal(auto[1], forced[1])


@fused_gemm
def test_tma_update_inside_the_linear_adds_the_bias():
    """Linear mode 3 (the update writes update + bias, cuBLAS adds x W^T) where the TMA kernel is the
    default, against float64; P comes out in float32."""
    M, K, N, r = 2100, 256, 1000, 8
    ran, _, (x, W, b, V, c, U) = _tma_case(M, K, N, r)
    assert ran
    ref = linear_ref64(x, W, b, V, c, U, 1.5)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
    poison_allocator(x.device, M * N)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3)
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
    assert rel_err(P, x.double() @ V.double()) < 1e-5


def test_default_dispatch_leaves_the_decode_kernels_above_16_tokens():
    """From 17 to 64 tokens the default is the GEMM with the update inside (linear mode 6: one launch, where
    the host's time is the bound) where the build runs it, and cuBLAS with the update kernel (linear mode 3)
    under CUDA-graph capture and elsewhere, bit-equal; the decode kernels stay the default at 16 tokens and
    can still be asked for above."""
    eager_mode = 6 if custom_ops._C.fused_gemm_available() else 3
    for M, expected_mode, captured_mode in ((16, 1, 1), (17, eager_mode, 3), (64, eager_mode, 3)):
        x, W, b, V, c, U = operands(M, 512, 384, 8, torch.bfloat16, codes=True, seed=M)
        auto, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 0)
        decode, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 5)
        prefill, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 3)
        expected = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, expected_mode)[0]
        assert not torch.equal(decode, prefill)
        assert torch.equal(auto, expected), f"M = {M}"
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            captured, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 0)
        graph.replay()
        torch.cuda.synchronize()
        expected = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, captured_mode)[0]
        assert torch.equal(captured, expected), f"M = {M}, captured"
