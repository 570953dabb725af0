"""The decode kernels (the BEM linear at 1-16 tokens: tiles, streaming, transposed-weight, row-split and TMA
kernels) and the decode dispatch against a float64 reference, error at most 2x PyTorch's in the same dtype."""

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


@pytest.mark.parametrize("split_k", [1, 2, 3, 7, 16])
def test_decode_tiles_split_k_is_exact_and_repeatable(split_k):
    """Every split count gives the right answer, twice in a row (the arrival counters reset themselves)."""
    x, W, b, V, c, U = operands(5, 2048, 640, 8, torch.bfloat16, codes=True, seed=split_k)
    ref = linear_ref64(x, W, b, V, c, U, 1.0)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.0), ref)
    first, P1 = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.0, 5, split_k)
    second, P2 = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.0, 5, split_k)
    assert rel_err(first, ref) <= bound(torch_err, torch.bfloat16)
    assert torch.equal(first, second) and torch.equal(P1, P2)
    assert rel_err(P1, x.double() @ V.double()) < 1e-2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 4096), (5, 2056, 1000), (8, 520, 130), (9, 264, 77),
                                   (16, 4096, 14336), (13, 14336, 520)])
@pytest.mark.parametrize("r", [1, 8, 13, 24, 32, 64, 128])
def test_decode_stream_kernel_matches_float64(dtype, split_k, M, K, N, r):
    """Mode 1, the decode dispatch: the streaming kernel (cluster split-K, K % 8 == 0, r <= 64) at every
    cluster size, the tiles kernel for larger ranks; odd N and odd ranks, with and without bias; two
    calls give identical bits (both sum their partial results in a fixed order)."""
    seed = stable_seed(M, K, N, r, split_k, str(dtype))
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=r != 13, seed=seed)
    decode_calls_agree(x, W, None if r == 64 else b, V, c, U, split_k)


def decode_calls_agree(x, W, bias, V, c, U, split_k, mode: int = 1) -> list[str]:
    """Linear mode `mode` (1: the decode dispatch) at `split_k` against float64 (poisoned output memory), twice
    with identical bits (P too), and the inference call (no P) identical to the first; returns the kernel
    names of the first call."""
    ref = linear_ref64(x, W, bias, V, c, U, 1.25)
    torch_err = rel_err(reference.bem_linear(x, W, bias, V, c, U, 1.25), ref)
    poison_allocator(x.device, x.shape[0] * W.shape[0])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        first, P1 = custom_ops._C.linear_forward(x, W, bias, V, c, U, 1.25, mode, split_k)
        torch.cuda.synchronize()
    second, P2 = custom_ops._C.linear_forward(x, W, bias, V, c, U, 1.25, mode, split_k)
    err = rel_err(first, ref)
    assert err <= bound(torch_err, x.dtype), f"kernel {err:.3g} vs torch {torch_err:.3g}"
    assert torch.equal(first, second) and torch.equal(P1, P2)
    assert rel_err(P1, x.double() @ V.double()) < 1e-2
    y_inference, _ = custom_ops._C.linear_forward(x, W, bias, V, c, U, 1.25, mode, split_k, False)
    assert torch.equal(y_inference, first)
    return [event.name for event in prof.events()]


hopper = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.get_device_capability()[0] < 9,
    reason="the streaming decode kernel needs a compute capability 9.0 GPU",
)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [0, 1, 2, 8])
@pytest.mark.parametrize("M,K,N", [(1, 768, 2304), (2, 3072, 768), (3, 7, 8), (4, 1000, 136), (4, 257, 4096),
                                   (1, 50000, 64)])
@pytest.mark.parametrize("r", [1, 8, 13, 33, 64])
def test_transposed_decode_kernel_matches_float64(dtype, split_k, M, K, N, r):
    """Mode 11 with a weight stored (K, N) (GPT-2's Conv1D, passed as its (N, K) view) at up to 4 tokens:
    the CUDA-core kernel for that layout (cluster split-K) at every cluster size, odd K and ranks, with
    and without bias and codes; two calls give identical bits (fixed-order sums); the profile names it."""
    seed = stable_seed(M, K, N, r, split_k, str(dtype), "columns")
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=r != 13, seed=seed)
    names = decode_calls_agree(x, conv1d_layout(W), None if r == 33 else b, V, c, U, split_k, mode=11)
    assert any("decode_columns_kernel" in name for name in names), names


@hopper
@pytest.mark.parametrize("M,K,N,r,kernel", [
    (1, 768, 2304, 8, "decode_columns_kernel"), (2, 768, 768, 16, "decode_columns_kernel"),
    (1, 3072, 768, 8, "decode_columns_mma_kernel"), (2, 1536, 768, 8, "decode_columns_mma_kernel"),
    (3, 768, 3072, 8, "decode_columns_mma_kernel"), (4, 768, 768, 16, "decode_columns_mma_kernel"),
    (4, 768, 2304, 13, "decode_columns_kernel"), (1, 3072, 768, 24, "decode_columns_kernel")])
def test_transposed_decode_dispatch_between_the_two_kernels(M, K, N, r, kernel):
    """Modes 0 and 1 with a weight stored (K, N): the CUDA-core kernel at 1-2 tokens where K < 2 N, the
    tensor-core kernel from 3 tokens and where K >= 2 N (ranks 8 and 16), the CUDA-core kernel at other ranks up
    to 4 tokens; both exact against float64."""
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r, "dispatch"))
    W = conv1d_layout(W)
    for mode in (0, 1):
        names = decode_calls_agree(x, W, b, V, c, U, 0, mode=mode)
        assert any(kernel in name for name in names) and sum("decode_columns" in n for n in names) == 1, names


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N", [(1, 576, 576), (5, 1016, 1000), (8, 520, 130), (9, 264, 77), (16, 1024, 257),
                                   (3, 8, 5), (1, 768, 48), (13, 1024, 4100), (2, 256, 16), (16, 512, 3),
                                   (1, 1536, 576), (16, 1528, 1000), (7, 1032, 33), (1, 2048, 512),
                                   (16, 2048, 2048), (9, 1544, 77), (4, 2040, 4100)])
@pytest.mark.parametrize("r", [1, 8, 13, 24, 64])
def test_decode_rows_kernel_matches_float64(dtype, M, K, N, r):
    """Mode 8, the row-split decode kernel (16 rows a block over all of K, no clusters): odd N, K from 8 to
    2048 (two, four, six and eight chunks a warp), odd ranks (up to 8 its X V shares x's fragments, above not),
    with and without bias and codes; two calls give identical bits (fixed-order sums); the profile names
    it."""
    seed = stable_seed(M, K, N, r, str(dtype), "rows")
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=r != 13, seed=seed)
    names = decode_calls_agree(x, W, None if r == 24 else b, V, c, U, 0, mode=8)
    assert any("decode_rows_kernel" in name for name in names), names


@hopper
@fused_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("M,K,N", [(1, 4096, 4096), (5, 2056, 1000), (8, 520, 130), (9, 264, 77), (16, 1536, 8960),
                                   (13, 8960, 520), (16, 8, 3), (3, 72, 129), (16, 8192, 2048), (2, 1000, 4100)])
@pytest.mark.parametrize("r", [1, 8, 13, 24, 64])
def test_decode_tma_kernel_matches_float64(dtype, split_k, M, K, N, r):
    """Mode 9, the TMA decode kernel (W's stages by tensor-map copies, wgmma, cluster split-K) at every cluster
    size: odd N (rows past it come in as zeros), K not a multiple of 64 (the last stage's columns too), slices
    that leave a block of the cluster with nothing (K = 8 over 8 blocks), odd ranks, with and without bias and
    codes; two calls give identical bits (fixed-order sums); the profile names it."""
    seed = stable_seed(M, K, N, r, split_k, str(dtype), "tma")
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=r != 13, seed=seed)
    names = decode_calls_agree(x, W, None if r == 24 else b, V, c, U, split_k, mode=9)
    assert any("decode_tma_kernel" in name for name in names), names


@hopper
@fused_gemm
@pytest.mark.parametrize("M,K,N,kernel", [(16, 8960, 1536, "decode_tma_kernel"), (1, 2048, 8192, "decode_tma_kernel"),
                                          (9, 3072, 3000, "decode_tma_kernel"), (16, 1536, 8960, "decode_stream_kernel"),
                                          (4, 2048, 2048, "decode_rows_kernel")])
def test_captured_decode_dispatch_takes_the_tma_kernel_from_k_2048(M, K, N, kernel, tmp_path):
    """Mode 1 without a split, captured into a CUDA graph (where the TMA kernel's projection launch costs no host
    time): the TMA kernel from K = 2048 up where the row kernel does not take the shape, the streaming kernel
    below; the graph's own dump names the kernel, and its replay is exact against float64."""
    x, W, b, V, c, U = operands(M, K, N, 8, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, "captured"))
    ref = linear_ref64(x, W, b, V, c, U, 1.25)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.25), ref)

    out, dump = captured_replay(lambda: custom_ops._C.linear_forward(x, W, b, V, c, U, 1.25, 0, 0, False)[0], tmp_path)
    assert kernel in dump
    assert rel_err(out, ref) <= bound(torch_err, torch.bfloat16)


def captured_replay(call, tmp_path) -> tuple[torch.Tensor, str]:
    """`call` once eagerly (the build's sm_90a probe runs there), then captured into a CUDA graph whose output is
    poisoned and replayed: (the replay's output, the graph's own dump, which names its kernels)."""
    call()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)  # the captured cudaGraph_t stays for the dump
    graph.enable_debug_mode()
    with torch.cuda.graph(graph):
        out = call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    graph.debug_dump(str(tmp_path / "graph.dot"))
    return out, (tmp_path / "graph.dot").read_text()


@hopper
@pytest.mark.parametrize("M,K,N,rows", [(1, 576, 576, True), (16, 576, 1536, True), (1, 1536, 576, True),
                                        (16, 2048, 2048, True), (1, 2048, 512, True), (1, 576, 8192, False),
                                        (1, 2056, 2048, False), (16, 3072, 3072, False)])
def test_decode_dispatch_takes_the_row_kernel_for_small_matrices(M, K, N, rows):
    """Mode 1 without a split: the row-split kernel where K is at most 2048 and N at most 4096 (every linear
    of SmolLM-135M, Llama-1B's attention projections), the streaming kernel otherwise; both exact."""
    x, W, b, V, c, U = operands(M, K, N, 8, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, "dispatch"))
    names = decode_calls_agree(x, W, b, V, c, U, 0)
    assert any("decode_rows_kernel" in n for n in names) == rows, names
    assert any("decode_stream_kernel" in n for n in names) == (not rows), names


@hopper
@pytest.mark.parametrize("graph", [False, True])
@pytest.mark.parametrize("K,N,mode,kernel", [(1536, 576, 8, "decode_rows_kernel"),
                                             (4096, 4096, 1, "decode_stream_kernel")])
def test_decode_kernels_read_what_the_kernel_before_them_wrote(graph, K, N, mode, kernel):
    """The row-split kernel may start before the kernel ahead of it on the stream has finished (it only
    prefetches W into L2 until that is done; the streaming kernel's in-block form, beside it, starts in
    order). A copy into x, W, the bias, V, the codes or U right before the call is seen, eagerly and
    inside a CUDA graph (where the copy is the node before it)."""
    M, r = 4, 8
    first = operands(M, K, N, r, torch.bfloat16, codes=True, seed=5)
    fresh = operands(M, K, N, r, torch.bfloat16, codes=True, seed=6)
    live = [t.clone() for t in first]

    def call():
        return custom_ops._C.linear_forward(*live, 1.25, mode, 0, False)[0]

    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        call()
        torch.cuda.synchronize()
    assert any(kernel in event.name for event in prof.events())
    for i in range(6):  # each operand in turn takes its fresh value just before the call
        for t, value in zip(live, first):
            t.copy_(value)
        if graph:
            g = torch.cuda.CUDAGraph()
            with torch.cuda.graph(g):
                live[i].copy_(fresh[i])
                out = call()
            g.replay()
            y = out.clone()
        else:
            live[i].copy_(fresh[i])
            y = call()
        now = [fresh[j] if j == i else first[j] for j in range(6)]
        ref = linear_ref64(*now, 1.25)
        torch_err = rel_err(reference.bem_linear(*now, 1.25), ref)
        assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16), f"operand {i} (graph={graph})"


@hopper
@pytest.mark.parametrize("M,N,r,kernel", [(5, 2304, 8, "decode_columns_mma_kernel"),
                                          (16, 768, 16, "decode_columns_mma_kernel"),
                                          (1, 130, 8, "decode_linear_kernel"), (6, 130, 8, "decode_linear_kernel"),
                                          (8, 768, 13, "decode_linear_kernel"), (16, 768, 24, "decode_linear_kernel")])
def test_transposed_decode_beyond_the_column_kernel(M, N, r, kernel):
    """Five to sixteen tokens at rank 8 or 16 with N a multiple of 8: the tensor-core kernel for the transposed
    weight; N not a multiple of 8, or another rank: the tiles kernel. Both exact."""
    x, W, b, V, c, U = operands(M, 768, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, N, "tiles"))
    W = conv1d_layout(W)
    ref = linear_ref64(x, W, b, V, c, U, 1.25)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.25), ref)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y, _ = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.25, 1)
        torch.cuda.synchronize()
    names = [event.name for event in prof.events()]
    assert not any("decode_columns_kernel" in name for name in names) and any(kernel in n for n in names), names
    assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)


@hopper
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("split_k", [0, 1, 2, 4, 8])
@pytest.mark.parametrize("M,K,N", [(5, 768, 2304), (16, 768, 768), (16, 3072, 768), (9, 1000, 136), (12, 776, 4104),
                                   (1, 264, 64), (16, 8, 8), (7, 40, 2056), (3, 50000, 16)])
@pytest.mark.parametrize("r", [8, 16])
def test_transposed_mma_decode_kernel_matches_float64(dtype, split_k, M, K, N, r):
    """Mode 10, the tensor-core kernel for a weight stored (K, N): K not a multiple of 16 (the last chunk's rows
    come in as zeros), slices that leave warps or whole blocks of the cluster without rows (K = 8 over 8 blocks),
    N from 8 to 4104 (a partial last block of columns), 1 to 16 tokens, ranks 8 and 16, with and without bias
    and codes; two calls give identical bits (fixed-order sums); the profile names it."""
    seed = stable_seed(M, K, N, r, split_k, str(dtype), "columns mma")
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=M % 2 == 1, seed=seed)
    names = decode_calls_agree(x, conv1d_layout(W), b if N % 16 == 8 else None, V, c, U, split_k, mode=10)
    assert any("decode_columns_mma_kernel" in name for name in names), names


@hopper
@pytest.mark.parametrize("case", ["rank", "row-major", "tokens", "split"])
def test_transposed_mma_decode_kernel_refuses_what_it_does_not_take(case):
    """Mode 10 asked for where it does not run: a clear error naming the kernel and its limits, no launch."""
    r = 13 if case == "rank" else 8
    M = 17 if case == "tokens" else 4
    x, W, b, V, c, U = operands(M, 256, 64, r, torch.bfloat16, codes=True, seed=stable_seed(case, "mma refusals"))
    W = W if case == "row-major" else conv1d_layout(W)
    split = 3 if case == "split" else 0
    with pytest.raises(ValueError, match="tensor-core transposed-weight decode kernel"):
        custom_ops._C.linear_forward(x, W, b, V, c, U, 1.0, 10, split)


@hopper
@pytest.mark.parametrize("case", ["rank", "row-major", "tokens", "split", "columns"])
def test_transposed_decode_kernel_refuses_what_it_does_not_take(case):
    """Mode 11 asked for where it does not run: a clear error naming the kernel and its limits, no launch."""
    r = 65 if case == "rank" else 8
    M = 5 if case == "tokens" else 2
    N = 60 if case == "columns" else 64
    x, W, b, V, c, U = operands(M, 256, N, r, torch.bfloat16, codes=True, seed=stable_seed(case, "columns refusals"))
    W = W if case == "row-major" else conv1d_layout(W)
    split = 3 if case == "split" else 0
    with pytest.raises(ValueError, match="transposed-weight decode kernel (takes|splits)"):
        custom_ops._C.linear_forward(x, W, b, V, c, U, 1.0, 11, split)


@hopper
def test_captured_transposed_decode_takes_the_tensor_core_kernel(tmp_path):
    """GPT-2's Conv1D at 16 tokens, captured into a CUDA graph (compiled decoding at batch 16): one launch of the
    tensor-core kernel, where the update kernel and cuBLAS ran before; the replay is exact against float64."""
    x, W, b, V, c, U = operands(16, 768, 2304, 8, torch.bfloat16, codes=True, seed=stable_seed("captured conv1d"))
    W = conv1d_layout(W)
    ref = linear_ref64(x, W, b, V, c, U, 1.25)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.25), ref)

    out, dump = captured_replay(lambda: custom_ops._C.linear_forward(x, W, b, V, c, U, 1.25, 0, 0, False)[0], tmp_path)
    assert "decode_columns_mma_kernel" in dump and "gemm" not in dump.lower()
    assert rel_err(out, ref) <= bound(torch_err, torch.bfloat16)


@hopper
@pytest.mark.parametrize("M,K,N,r,projects", [(1, 4096, 4096, 32, True), (16, 14336, 1000, 8, True),
                                              (16, 4096, 1000, 64, True), (1, 4096, 4096, 8, False)])
def test_decode_stream_reads_each_calls_own_projection(M, K, N, r, projects):
    """Above rank 16, or with slices of K longer than 1024, the streaming decode is two launches: the
    projection Pc = s (x V) ⊙ c, then the stream over W, which starts before the projection has
    finished and waits for it only before the update's share; otherwise one launch computes its own
    share. Twenty calls back to back, each with its own codes (and its own Pc, allocated where the
    last call's was freed), each match float64: no stream reads another call's projection. The profile
    names the launches."""
    x, W, b, V, _, U = operands(M, K, N, r, torch.bfloat16, codes=False, seed=stable_seed(M, K, N, r))
    g = torch.Generator(device="cuda").manual_seed(stable_seed(M, K, N, r, "codes"))
    codes = [torch.randn(M, r, device=x.device, generator=g).to(x.dtype) for _ in range(20)]
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        outs = [custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, 1, 0, False)[0] for c in codes]
        torch.cuda.synchronize()
    names = {event.name for event in prof.events()}
    assert any("decode_stream_kernel" in n for n in names)
    assert any("decode_project_kernel" in n for n in names) == projects
    for out, c in zip(outs, codes):
        ref = linear_ref64(x, W, b, V, c, U, 1.5)
        torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
        assert rel_err(out, ref) <= bound(torch_err, torch.bfloat16)


@hopper
@pytest.mark.parametrize("mode,split_k", [(1, 0), (1, 8), (5, 4)])
@pytest.mark.parametrize("M", [1, 16])
def test_split_k_decode_errs_no_more_than_pytorch_over_many_codes(mode, split_k, M):
    """Where K is split, each block's share of the update comes from a partial x V, whose coefficient the
    kernels keep to 16 bits of mantissa (a high and a low part) rather than rounding each partial to the
    dtype. Over 200 draws of the codes (a test's handful samples the error's tail only by luck) every
    output stays within the bound."""
    K, N, r = 4096, 4096, 8
    x, W, b, V, _, U = operands(M, K, N, r, torch.bfloat16, codes=False, seed=stable_seed(M, mode, split_k, "tail"))
    g = torch.Generator(device="cuda").manual_seed(stable_seed(M, mode, split_k, "tail codes"))
    for _ in range(200):
        c = torch.randn(M, r, device="cuda", generator=g).to(x.dtype)
        out = custom_ops._C.linear_forward(x, W, b, V, c, U, 1.5, mode, split_k, False)[0]
        ref = linear_ref64(x, W, b, V, c, U, 1.5)
        torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.5), ref)
        assert rel_err(out, ref) <= bound(torch_err, torch.bfloat16)


def test_decode_dispatch_takes_unaligned_operands():
    """x or V starting 2 bytes past a 16-byte boundary: the streaming kernel's 16-byte loads of x cannot
    read such an x, so the decode dispatch hands it to the tiles kernel; such a V it reads by elements
    (an aligned V with r % 8 == 0 by rows, through the staging tile). Every
    combination gives the right result."""
    x, W, b, V, c, U = operands(3, 1024, 640, 16, torch.bfloat16, codes=True, seed=11)
    ref = linear_ref64(x, W, b, V, c, U, 1.0)
    torch_err = rel_err(reference.bem_linear(x, W, b, V, c, U, 1.0), ref)
    V_off = torch.empty(V.numel() + 1, device=V.device, dtype=V.dtype)[1:].view_as(V).copy_(V)
    x_off = torch.empty(x.numel() + 1, device=x.device, dtype=x.dtype)[1:].view_as(x).copy_(x)
    for xs, Vs in ((x, V_off), (x_off, V), (x_off, V_off)):
        y, _ = custom_ops._C.linear_forward(xs, W, b, Vs, c, U, 1.0, 1)
        assert rel_err(y, ref) <= bound(torch_err, torch.bfloat16)
