"""The backward's two paths against float64, for every combination of gradients asked for: decode sizes
(cuBLAS dY W beside two small kernels for G = dY U, dU, dV, dcodes and the update's share of dX) and
prefill sizes (dX and G from the forward's dispatch run on dY, W^T, U and V, or dX from the fused GEMM; the
low-rank pieces composed, one coefficient kernel and cuBLAS dV and dU, or fused, two launches)."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import custom_ops, ops, reference

from .kernel_helpers import bound, operands, poison_allocator, rel_err, stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", [(1, 64, 40, 1), (5, 200, 77, 5), (16, 512, 1024, 32), (33, 136, 264, 100),
                                     (64, 256, 128, 128), (7, 1000, 24, 16), (2, 96, 5000, 12)])
@pytest.mark.parametrize("with_codes", [True, False])
@pytest.mark.parametrize("with_weight", [True, False])
def test_decode_backward_op_matches_float64(dtype, M, K, N, r, with_codes, with_weight):
    """The op itself: odd sizes, ranks not a multiple of 8, more than 32 chunks of dY (N = 5000)."""
    seed = stable_seed(dtype, M, K, N, r, with_codes, with_weight)
    x, W, _, V, c, U = operands(M, K, N, r, dtype, codes=with_codes, seed=seed)
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    dy = torch.randn(M, N, device="cuda", generator=g).to(dtype)
    P = torch.randn(M, r, device="cuda", generator=g)
    s = 0.7
    poison_allocator(x.device, (K + N + M) * r + M * K)
    outs = custom_ops._C.decode_backward(x, dy, W if with_weight else None, V, U, P, c, s)
    c64 = torch.ones(M, r, dtype=torch.float64, device="cuda") if c is None else c.double()
    G64 = dy.double() @ U.double()
    refs = {"dX": s * (G64 * c64) @ V.double().t() + (dy.double() @ W.double() if with_weight else 0),
            "dV": s * x.double().t() @ (G64 * c64), "dcodes": s * G64 * P.double(),
            "dU": s * dy.double().t() @ (P.double() * c64)}
    # PyTorch in the same dtype: G from cuBLAS, the coefficients rounded to the dtype
    G, c32 = dy @ U, c64.float()
    low = (s * G.float() * c32).to(dtype)
    torch_out = {"dX": low @ V.t() + (dy @ W if with_weight else 0), "dV": x.t() @ low,
                 "dcodes": (s * G.float() * P).to(dtype), "dU": dy.t() @ (s * P * c32).to(dtype)}
    for name, out in zip(("dX", "dV", "dcodes", "dU"), outs):
        assert out.dtype == dtype and out.shape == refs[name].shape
        torch_err = rel_err(torch_out[name], refs[name])
        assert rel_err(out, refs[name]) <= bound(torch_err, dtype), f"{name}: {rel_err(out, refs[name]):.3g}"


def _grads(fn, leaves, dy):
    for t in leaves:
        t.grad = None
    fn(*leaves).backward(dy)
    return [t.grad for t in leaves]


WANTS = {"all": (True, True, True, True), "no_x": (False, True, True, True),
         "no_codes": (True, True, False, True), "only_u": (False, False, False, True)}


def _check_gradients(op, M, K, N, r, dtype, needs, scale, seed, path_name, calls):
    """Gradients of the fused op (leaves x, V, codes, U as `needs` asks) against float64 and PyTorch in
    the same dtype; `calls` must have been filled by the path under test. Where eager autograd runs the linear
    through the extension's C++ autograd function (which calls no Python, so fills no `calls`), its gradients are
    checked, then the custom op's autograd formula's, whose Python path the caller watches."""
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=True, seed=seed)
    if op == "linear_conv1d":
        W = W.t().contiguous().t()  # GPT-2 Conv1D: the transposed view of a (K, N) buffer
    wants = WANTS[needs]

    def make(module, w, bias):
        if op == "update":
            return lambda x, V, c, U: module.generated_update(x, V, c, U, scale)
        return lambda x, V, c, U: module.bem_linear(x, w, bias, V, c, U, scale)

    dy = torch.randn(M, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M)).to(dtype)
    leaves = [t.detach().requires_grad_(want) for t, want in zip((x, V, c, U), wants)]
    ref_leaves = [t.detach().double().requires_grad_(want) for t, want in zip(leaves, wants)]
    ref = _grads(make(reference, W.double(), b.double()), ref_leaves, dy.double())
    torch_grads = _grads(make(reference, W, b), leaves, dy)
    poison_allocator(x.device, (M + K + N) * r + M * max(K, N))
    kernel_grads = [_grads(make(ops, W, b), leaves, dy)]
    if not calls and op != "update":  # eager autograd took the extension's C++ function (ranks up to its maximum)
        poison_allocator(x.device, (M + K + N) * r + M * max(K, N))
        through_op = lambda x, V, c, U: custom_ops.fused_bem_linear(x, W, b, V, c, U, scale)[0]  # noqa: E731
        kernel_grads.append(_grads(through_op, leaves, dy))
    assert calls, f"the {path_name} backward did not run"
    for grads in kernel_grads:
        for name, want, k, t, r64 in zip(("x", "V", "codes", "U"), wants, grads, torch_grads, ref):
            if not want:
                assert k is None, f"d{name} computed though not asked for"
                continue
            torch_err = rel_err(t, r64)
            assert rel_err(k, r64) <= bound(torch_err, dtype), f"d{name}: {rel_err(k, r64):.3g} vs torch {torch_err:.3g}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", [(1, 256, 512, 8), (16, 520, 264, 32), (64, 128, 96, 64), (3, 96, 200, 128),
                                     (9, 77, 45, 3)])
@pytest.mark.parametrize("op", ["linear", "linear_conv1d", "update"])
@pytest.mark.parametrize("needs", ["all", "no_x", "no_codes", "only_u"])
def test_decode_backward_matches_float64(dtype, M, K, N, r, op, needs, monkeypatch):
    """Gradients of the fused ops at decode sizes, with the decode path shown to run."""
    calls = []
    real = custom_ops._decode_backward
    monkeypatch.setattr(custom_ops, "_decode_backward", lambda *a: calls.append(1) or real(*a))
    _check_gradients(op, M, K, N, r, dtype, needs, 1.3, stable_seed(dtype, M, K, N, r, op, needs), "decode-size", calls)


def test_decode_backward_is_not_taken_above_decode_sizes(monkeypatch):
    calls = []
    monkeypatch.setattr(custom_ops, "_decode_backward", lambda *a: calls.append(1))
    x, W, b, V, c, U = operands(65, 64, 32, 8, torch.bfloat16, codes=True, seed=3)
    V.requires_grad_()
    custom_ops.fused_bem_linear(x, W, b, V, c, U, 1.0)[0].float().sum().backward()
    assert not calls and V.grad is not None


def _backward_kernels(M, x_grad, r=8, K=64, N=32):
    """Names of the CUDA kernels an eager backward of the fused linear at M rows ran (the C++ autograd function)."""
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=M)
    leaves = [x.requires_grad_(x_grad), V.requires_grad_(), c.requires_grad_(), U.requires_grad_()]
    y = ops.bem_linear(leaves[0], W, b, *leaves[1:], 1.0)
    assert "FusedLinearFunction" in y.grad_fn.name(), y.grad_fn.name()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        y.float().sum().backward()
        torch.cuda.synchronize()
    return {e.key for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA}


@pytest.mark.parametrize("x_grad", [True, False])
def test_eager_backward_takes_the_decode_kernels_up_to_64_rows(x_grad):
    """The C++ backward's choice, seen in the kernels it ran: the decode-size kernels (grads_u_kernel and
    grads_v_kernel, csrc/lowrank/lowrank_grads.cu) at 64 rows, not at 65."""
    def decode_ran(names):
        return any("grads_u_kernel" in name for name in names) and any("grads_v_kernel" in name for name in names)

    assert decode_ran(_backward_kernels(64, x_grad))
    assert not decode_ran(_backward_kernels(65, x_grad))


def _fused_grads_ran(names):
    return [any(kernel in name for name in names) for kernel in ("prefill_coefficients_kernel",
                                                                 "prefill_weight_grads_kernel")]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", [(65, 64, 72, 8), (300, 96, 80, 16), (1000, 576, 1536, 8), (4097, 136, 264, 16),
                                     (8192, 576, 576, 8), (3001, 2048, 512, 16)])
@pytest.mark.parametrize("grads_path", ["fused", "composed"])
@pytest.mark.parametrize("needs", ["all", "no_x", "no_codes", "only_u"])
def test_prefill_grads_paths_match_float64(dtype, M, K, N, r, grads_path, needs, monkeypatch):
    """The prefill backward's low-rank pieces both ways: fused (the coefficients from projections summed on chip,
    then dV and dU with rows split over blocks: one split at 65 and 300 rows, several above) and composed (cuBLAS),
    with dX from the fused GEMM where the build has it (the fused pieces run with that dX path or without dX)."""
    if not custom_ops._C.fused_gemm_available() and needs in ("all", "no_codes"):
        pytest.skip("dX beside the fused pieces comes from the fused GEMM (sm_90a)")
    calls = []
    for name in ("_prefill_backward", "_grads_from_g"):
        real = getattr(custom_ops, name)
        monkeypatch.setattr(custom_ops, name, lambda *a, real=real: calls.append(1) or real(*a))
    dx_path = "gemm" if custom_ops._C.fused_gemm_available() else None
    with custom_ops.prefill_grads_path(grads_path), custom_ops.prefill_dx_path(dx_path):
        _check_gradients("linear", M, K, N, r, dtype, needs, 0.8, stable_seed(dtype, M, K, N, r, grads_path, needs),
                         "prefill", calls)


@pytest.mark.parametrize("x_grad", [True, False])
def test_eager_backward_takes_the_fused_grads_by_the_measured_rule(x_grad):
    """Seen in the kernels the eager backward ran: the two fused launches by default at rank 8 and small work
    (without dX, and with dX from the fused GEMM), none when the composition is forced, none by default at rank 16
    or above the rule's work (4096 x 4096², forced: taken), and none at a rank they do not take (12)."""
    dx_path = "gemm" if custom_ops._C.fused_gemm_available() else None
    if x_grad and dx_path is None:
        pytest.skip("the fused pieces run beside the fused GEMM's dX (sm_90a)")
    with custom_ops.prefill_dx_path(dx_path):
        assert _fused_grads_ran(_backward_kernels(300, x_grad)) == [True, True]
        with custom_ops.prefill_grads_path("composed"):
            assert _fused_grads_ran(_backward_kernels(300, x_grad)) == [False, False]
        assert _fused_grads_ran(_backward_kernels(300, x_grad, r=16)) == [False, False]
        assert _fused_grads_ran(_backward_kernels(4096, x_grad, K=4096, N=4096)) == [False, False]
        with custom_ops.prefill_grads_path("fused"):
            assert _fused_grads_ran(_backward_kernels(300, x_grad, r=16)) == [True, True]
            assert _fused_grads_ran(_backward_kernels(4096, x_grad, K=4096, N=4096)) == [True, True]
    assert _fused_grads_ran(_backward_kernels(300, x_grad, r=12)) == [False, False]


def test_forced_fused_grads_refuse_a_rank_they_do_not_take():
    x, W, b, V, c, U = operands(300, 64, 32, 12, torch.bfloat16, codes=True, seed=5)
    dy = torch.randn(300, 32, device="cuda", dtype=torch.bfloat16)
    with custom_ops.prefill_grads_path("fused"), pytest.raises(
            ValueError, match=r"the fused prefill gradients take ranks 8 and 16, .*got x \(300, 64\), "
                              r"grad_y \(300, 32\), V \(64, 12\)"):
        custom_ops._C.prefill_weight_grads(x, dy, V, U, c, 1.0)


@pytest.mark.parametrize("M", [4, 300])
def test_backward_in_a_cuda_graph(M):
    """Both backward paths fork onto a side stream beside cuBLAS and join again: capture and replay must
    hold (4 rows: the decode-size path; 300: the prefill path)."""
    K, N, r = 384, 512, 16
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=21)
    leaves = [t.detach().requires_grad_() for t in (x, V, c, U)]
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)

    def grads():
        y = ops.bem_linear(leaves[0], W, b, leaves[1], leaves[2], leaves[3], 0.9)
        return torch.autograd.grad(y, leaves, dy)

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            grads()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static = grads()
    for seed in range(3):
        fresh = operands(M, K, N, r, torch.bfloat16, codes=True, seed=200 + seed)
        with torch.no_grad():
            for leaf, new in zip(leaves, (fresh[0], fresh[3], fresh[4], fresh[5])):
                leaf.copy_(new)
            dy.copy_(torch.randn(M, N, device="cuda", dtype=torch.bfloat16))
        graph.replay()
        eager = grads()
        for name, g_graph, g_eager in zip(("x", "V", "codes", "U"), static, eager):
            # the same kernels on the same inputs; a stale or partial replay would differ by O(1)
            assert rel_err(g_graph, g_eager.double()) < 1e-2, f"d{name} differs between graph replay and eager"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", [(65, 256, 200, 8), (300, 136, 264, 13), (1100, 512, 384, 16),
                                     (2048, 256, 512, 32), (1030, 96, 80, 64)])
@pytest.mark.parametrize("op", ["linear", "linear_conv1d", "update"])
@pytest.mark.parametrize("needs", ["all", "no_x", "only_u"])
def test_prefill_backward_matches_float64(dtype, M, K, N, r, op, needs, monkeypatch):
    """Above 64 rows, dX from the update kernels on dY: the streaming update kernel (1100 rows, r = 16),
    two cuBLAS GEMMs (2048, r = 32), the tiles kernel (odd sizes), under W^T as the forward's weight."""
    calls = []
    for name in ("_prefill_backward", "_grads_from_g"):  # with dX asked for of a linear; otherwise
        real = getattr(custom_ops, name)
        monkeypatch.setattr(custom_ops, name, lambda *a, real=real: calls.append(1) or real(*a))
    with custom_ops.prefill_dx_path("update"):
        _check_gradients(op, M, K, N, r, dtype, needs, 0.8, stable_seed(dtype, M, K, N, r, op, needs), "prefill",
                         calls)


fused_gemm = pytest.mark.skipif(
    not ops.KERNELS_AVAILABLE or not custom_ops._C.fused_gemm_available(),
    reason="the fused GEMM needs a compute capability 9.0 GPU and an sm_90a build",
)


@fused_gemm
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M,K,N,r", [(65, 256, 200, 8), (300, 136, 264, 16), (1100, 520, 392, 24),
                                     (2048, 256, 512, 32), (1030, 96, 80, 64), (5000, 768, 776, 40)])
@pytest.mark.parametrize("op", ["linear", "linear_conv1d"])
@pytest.mark.parametrize("path", ["update", "gemm"])
def test_prefill_dx_paths_match_float64(dtype, M, K, N, r, op, path, monkeypatch):
    """Both ways of computing the prefill backward's dX, each shown to run: the update kernels on dY with
    cuBLAS adding dY W, and the fused GEMM given s (dY U) ⊙ codes, which reads an nn.Linear weight
    transposed (and a Conv1D one, whose W^T is row-major, as it is)."""
    chosen = []
    real = custom_ops._dx_in_gemm
    monkeypatch.setattr(custom_ops, "_dx_in_gemm", lambda *a: chosen.append(real(*a)) or chosen[-1])
    with custom_ops.prefill_dx_path(path):
        _check_gradients(op, M, K, N, r, dtype, "all", 0.8, stable_seed(dtype, M, K, N, r, op, path), "prefill",
                         chosen)
    assert chosen == [path == "gemm"]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("with_codes", [True, False])
def test_backward_coefficients_match_float64(dtype, with_codes):
    g = torch.Generator(device="cuda").manual_seed(3)
    M, r, s = 777, 13, 1.7
    G, P = torch.randn(M, r, device="cuda", generator=g), torch.randn(M, r, device="cuda", generator=g)
    c = (1 + 0.5 * torch.randn(M, r, device="cuda", generator=g)).to(dtype) if with_codes else None
    poison_allocator(G.device, 3 * M * r)
    g_c, p_c, g_p = custom_ops._C.backward_coefficients(G, P, c, s, dtype)
    c64 = 1.0 if c is None else c.double()
    for out, ref in ((g_c, s * G.double() * c64), (p_c, s * P.double() * c64), (g_p, s * G.double() * P.double())):
        assert out.dtype == dtype
        # one rounding of an fp32 product to the dtype
        assert rel_err(out, ref) <= torch.finfo(dtype).eps, rel_err(out, ref)


@fused_gemm
def test_fused_gemm_dx_is_the_default_where_it_measured_faster():
    """The measured rule (`backward_dx_in_gemm`): 512 to 1023 rows from r = 16; K x N up to 2048² from r = 16,
    or at r = 8 once the 128-column tiles are as many as the multiprocessors; not at 128 rows of larger
    shapes, not from 1024 rows of 4096², not at r = 8 between, not where the GEMM does not take the rank."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count  # 2048 columns: 16 tiles per 128 rows
    cases = [(512, 4096, 4096, 16, True), (1023, 14336, 4096, 32, True), (700, 4096, 14336, 64, True),
             (511, 4096, 4096, 32, False), (1024, 4096, 4096, 64, False), (512, 4096, 4096, 8, False),
             (128, 768, 768, 32, True), (128, 2048, 2048, 8, False), (16384, 768, 768, 8, True),
             (128 * -(-sms // 16), 2048, 2048, 8, True), (128 * (-(-sms // 16) - 1), 2048, 2048, 8, False),
             (700, 4096, 4096, 12, False), (4096, 4096, 14336, 32, False)]
    for M, K, N, r, expected in cases:
        dy = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
        W = torch.empty(N, K, device="cuda", dtype=torch.bfloat16)
        V = torch.empty(K, r, device="cuda", dtype=torch.bfloat16)
        assert custom_ops._C.backward_dx_in_gemm(dy, W.t(), V) is expected, f"M = {M}, K = {K}, N = {N}, r = {r}"


@fused_gemm
@pytest.mark.parametrize("M,r,expected", [(600, 32, "gemm"), (300, 8, "update")])
def test_default_prefill_dx_is_bit_equal_to_the_chosen_path(M, r, expected):
    K, N = 1024, 2048 if expected == "update" else 1024
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, r))
    dy = torch.randn(M, N, device="cuda", dtype=torch.bfloat16)
    leaves = [t.detach().requires_grad_() for t in (x, V, c, U)]

    def grads(path):
        with custom_ops.prefill_dx_path(path):
            return torch.autograd.grad(ops.bem_linear(leaves[0], W, b, *leaves[1:], 0.7), leaves, dy)

    default, chosen, other = grads(None), grads(expected), grads("gemm" if expected == "update" else "update")
    assert torch.equal(default[0], chosen[0]) and not torch.equal(default[0], other[0])


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("lead,K,N,r", [((3, 100), 256, 200, 8), ((2, 700), 520, 392, 16), ((5, 8), 136, 264, 13)])
@pytest.mark.parametrize("needs", ["all", "no_x", "no_codes", "only_u"])
@pytest.mark.parametrize("given", ["bias and codes", "no bias", "no codes"])
def test_eager_autograd_calls_the_extension_directly_with_the_custom_ops_numbers(dtype, lead, K, N, r, needs, given):
    """Eager autograd on (batch, sequence, K) inputs takes the extension's C++ autograd function (not the custom
    op's dispatch) and gives the custom op's gradients, up to one rounding where cuBLAS may pick another algorithm
    on another stream. Without x's gradient ("no_x", "only_u") at 300 and 1400 rows, the C++ backward's own path
    (`prefill_weight_grads`: the fused launches where the rule takes the shape, else x V, dY U, the coefficients
    and two GEMMs) against the custom op's composition in Python. With and without a bias and codes, which move
    the other operands' places among the function's inputs."""
    M = lead[0] * lead[1]
    x, W, b, V, c, U = operands(M, K, N, r, dtype, codes=given != "no codes",
                                seed=stable_seed(dtype, lead, K, N, r, needs, given), lead=lead)
    b = None if given == "no bias" else b
    wants = WANTS[needs]
    dy = torch.randn(*lead, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M)).to(dtype)
    leaves = [None if t is None else t.detach().requires_grad_(want) for t, want in zip((x, V, c, U), wants)]
    graded = [t for t in leaves if t is not None and t.requires_grad]
    poison_allocator(x.device, (M + K + N) * r + M * max(K, N))
    y = ops.bem_linear(leaves[0], W, b, leaves[1], leaves[2], leaves[3], 0.6)
    assert "FusedLinearFunction" in y.grad_fn.name(), y.grad_fn.name()
    eager = torch.autograd.grad(y, graded, dy)
    flat = [None if t is None else
            (t.detach().reshape(M, t.shape[-1]) if t.dim() == 3 else t.detach()).requires_grad_(t.requires_grad)
            for t in leaves]
    y_op, _ = custom_ops.fused_bem_linear(flat[0], W, b, flat[1], flat[2], flat[3], 0.6)
    assert torch.equal(y.reshape(M, N), y_op)
    through_op = torch.autograd.grad(y_op, [t for t in flat if t is not None and t.requires_grad], dy.reshape(M, N))
    for got, want, leaf in zip(eager, through_op, graded):
        assert got.shape == leaf.shape
        assert rel_err(got.reshape(want.shape), want.double()) <= torch.finfo(dtype).eps


@pytest.mark.parametrize("path", ["eager", "op"])
@pytest.mark.parametrize("M", [5, 300])
def test_autograd_keeps_x_and_the_codes_but_no_float32_x_v(path, M):
    """What a training step holds between its forward and backward: x and the codes (as LoRA holds x and
    A x), never the (M, r) float32 x V, which the backward recomputes; at decode sizes and above."""
    K, N, r = 264, 200, 8
    x, W, b, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(path, M), lead=(1, M))
    leaves = [t.detach().requires_grad_() for t in (x, V, c, U)]
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        if path == "eager":
            y = ops.bem_linear(leaves[0], W, b, *leaves[1:], 0.6)
            assert "FusedLinearFunction" in y.grad_fn.name(), y.grad_fn.name()
        else:
            flat = [t.reshape(M, t.shape[-1]) if t.dim() == 3 else t for t in leaves]
            y, _ = custom_ops.fused_bem_linear(flat[0], W, b, flat[1], flat[2], flat[3], 0.6)
    assert saved and all(t.dtype == torch.bfloat16 for t in saved), [(t.dtype, tuple(t.shape)) for t in saved]
    assert not any(t.shape[-1] == r and t.numel() == M * r and t.data_ptr() != c.data_ptr() for t in saved)
    dy = torch.randn_like(y)
    got = torch.autograd.grad(y, leaves, dy)
    x64, V64, c64, U64 = (t.detach().double().reshape(-1, t.shape[-1]) for t in leaves)
    G64 = dy.double().reshape(M, N) @ U64
    P64 = x64 @ V64
    refs = (0.6 * (G64 * c64) @ V64.t() + dy.double().reshape(M, N) @ W.double(), 0.6 * x64.t() @ (G64 * c64),
            0.6 * G64 * P64, 0.6 * dy.double().reshape(M, N).t() @ (P64 * c64))
    for name, g, ref in zip(("dX", "dV", "dcodes", "dU"), got, refs):
        assert rel_err(g.reshape(ref.shape), ref) < 2e-2, f"{name}: {rel_err(g.reshape(ref.shape), ref):.3g}"


@pytest.mark.parametrize("M", [7, 300])
def test_backward_recomputes_x_v_as_the_given_one(M):
    """P = None (recomputed from x and V in the extension) gives the gradients a given float32 x V gives."""
    K, N, r = 136, 264, 13
    x, W, _, V, c, U = operands(M, K, N, r, torch.bfloat16, codes=True, seed=stable_seed(M, K, N, r))
    dy = torch.randn(M, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(M)).to(torch.bfloat16)
    P = custom_ops._C.project(x, V)
    if M <= custom_ops.decode_max_tokens():
        given = custom_ops._C.decode_backward(x, dy, W, V, U, P, c, 0.8)
        recomputed = custom_ops._C.decode_backward(x, dy, W, V, U, None, c, 0.8)
    else:
        given = custom_ops._C.prefill_backward(x, dy, W, V, U, P, c, 0.8, False)
        recomputed = custom_ops._C.prefill_backward(x, dy, W, V, U, None, c, 0.8, False)
    for name, a, b in zip(("dX", "dV", "dcodes", "dU"), given, recomputed):
        assert torch.equal(a, b), name
