"""The fftconv kernels against float64 references: the forward and the backward (block kernels up to L = 16384,
the four-step form up to 2^20, cuFFT with the element-wise kernels above), the decoding step, torch.compile and
CUDA graphs, and the argument checks of the bindings. The kernels' error is bounded by twice that of the PyTorch rfft path in the
same dtype (kernel_helpers.bound); outputs are poisoned before each run; NaN never passes."""

from __future__ import annotations

import pytest
import torch

from bem.kernels.fftconv import custom_ops, dispatch, reference

from .kernel_helpers import bound, poison_allocator, rel_err, stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or custom_ops.extension() is None,
                       reason="needs a CUDA GPU and the fftconv kernels"),
]

DTYPES = (torch.bfloat16, torch.float16, torch.float32)
F64 = torch.float64


def _operands(B, H, L, Lk, dtype, seed, gates=True, D=True, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape, scale=1.0, to=dtype):
        t = (torch.randn(*shape, device="cuda", generator=g) * scale).to(to)
        return t.requires_grad_() if requires_grad else t

    u = draw(B, H, L)
    k = draw(H, Lk, scale=Lk**-0.5, to=torch.float32 if dtype == torch.float32 else dtype)
    d = draw(H, to=torch.float32) if D else None
    pre = draw(B, H, L) if gates else None
    post = draw(B, H, L) if gates else None
    return u, k, d, pre, post


def _f64(*tensors):
    return [None if t is None else t.detach().double() for t in tensors]


def _reference64(u, k, D, pre, post, gelu):
    u, k, D, pre, post = _f64(u, k, D, pre, post)
    if u.shape[-1] <= 1000:
        return reference.fftconv_direct(u, k, D, pre, post, gelu)
    return reference.fftconv_fft(u, k, D, pre, post, gelu)  # float64 FFT on the GPU


FORWARD_CASES = [
    # (B, H, L, Lk)
    (2, 7, 1, 1), (3, 1, 3, 3), (2, 7, 255, 100), (2, 7, 256, 300), (2, 7, 1000, 1000), (1, 768, 1000, 1000),
    (2, 1, 4097, 4097), (1, 7, 8192, 5000), (2, 768, 4096, 4096), (1, 3, 16384, 16384), (1, 2, 100000, 100000),
    (1, 1, 1 << 20, 1 << 20),
    # the four-step forward's smallest and middle sizes (M1 = 4, 8), many heads, taps shorter and longer than L
    (3, 5, 16385, 700), (2, 3, 40001, 50000),
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,L,Lk", FORWARD_CASES)
def test_forward_within_twice_pytorchs_error(B, H, L, Lk, dtype):
    extras = (B * H * L) % 2 == 0  # gates, D and GELU on half of the cases
    u, k, D, pre, post = _operands(B, H, L, Lk, dtype, stable_seed("fwd", B, H, L, dtype), gates=extras,
                                   D=extras)
    ref = _reference64(u, k, D, pre, post, extras)
    torch_err = rel_err(reference.fftconv_fft(u, k, D, pre, post, extras), ref)
    poison_allocator(u.device, u.numel())
    y = dispatch.fftconv(u, k, D, pre, post, gelu=extras)
    assert y.dtype == dtype and y.shape == u.shape
    err = rel_err(y, ref)
    assert err <= bound(torch_err, dtype), f"error {err:.3g}, PyTorch's {torch_err:.3g}"


@pytest.mark.parametrize("L", [3000, 40000])
def test_cached_spectrum_gives_the_same_output_until_k_changes(L):
    u, k, D, pre, post = _operands(2, 7, L, L, torch.bfloat16, seed=1)
    dispatch.SPECTRA.clear()
    with torch.no_grad():
        first = dispatch.fftconv(u, k, D, pre, post, gelu=True)
        assert len(dispatch.SPECTRA._entries) == 1
        again = dispatch.fftconv(u, k, D, pre, post, gelu=True)
        assert torch.equal(first, again)
        k.mul_(-1.0)  # in place: the cached spectrum must not be used
        flipped = dispatch.fftconv(u, k, D, pre, post, gelu=True)
    ref = _reference64(u, k, D, pre, post, True)
    assert rel_err(flipped, ref) <= bound(rel_err(reference.fftconv_fft(u, k, D, pre, post, True), ref),
                                          torch.bfloat16)


@pytest.mark.parametrize("L,Lk", [(16385, 16385), (100000, 3000)])
def test_long_spectrum_is_rfft_in_the_four_step_order(L, Lk):
    k = torch.randn(3, Lk, device="cuda")
    M = custom_ops.spectrum_length(L)
    S = custom_ops.fftconv_spectrum(k, L)
    taps = min(L, Lk)
    natural = torch.fft.rfft(k[:, :taps].double(), n=2 * M)
    M2 = custom_ops.extension().FFTCONV_TILED_ROW_LENGTH
    expected = torch.cat([natural[:, :M].reshape(3, M2, M // M2).transpose(1, 2).reshape(3, M), natural[:, M:]], 1)
    assert S.shape == (3, M + 1)
    assert rel_err(torch.view_as_real(S), torch.view_as_real(expected)) < 1e-6


def test_strided_input_is_made_contiguous():
    u, k, D, _, _ = _operands(7, 2, 500, 500, torch.float32, seed=2, gates=False)
    strided = u.transpose(0, 1).contiguous().transpose(0, 1)
    assert not strided.is_contiguous()
    ref = _reference64(strided, k, D, None, None, False)
    assert rel_err(dispatch.fftconv(strided, k, D), ref) <= bound(rel_err(reference.fftconv_fft(strided, k, D), ref),
                                                                 torch.float32)


BACKWARD_CASES = [
    # (B, H, L, Lk, gates, D, gelu)
    (2, 7, 1, 1, True, True, True), (3, 1, 255, 100, True, True, False), (2, 7, 1000, 1000, False, True, True),
    (3, 2, 4097, 6000, True, False, True), (5, 1, 2048, 2048, False, False, False),
    (1, 3, 16384, 16384, True, True, True), (2, 1, 100000, 100000, True, True, True),
    # the four-step backward: g = dy (no activation pass), dk summed over 3 batch rows, taps short of L; and
    # gates without GELU (dpostgate: the activation pass), taps past L
    (3, 2, 20000, 5000, False, True, False), (2, 3, 40001, 50000, True, False, False),
]


def _grads(fn, operands, grad_y):
    leaves = [t for t in operands if t is not None]
    return torch.autograd.grad(fn(*operands), leaves, grad_y)


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,L,Lk,gates,D,gelu", BACKWARD_CASES)
def test_backward_within_twice_pytorchs_error(B, H, L, Lk, gates, D, gelu, dtype):
    operands = _operands(B, H, L, Lk, dtype, stable_seed("bwd", B, H, L, dtype), gates=gates, D=D,
                         requires_grad=True)
    grad_y = torch.randn(B, H, L, device="cuda", dtype=F64).to(dtype)
    ref = _grads(lambda *a: reference.fftconv_fft(*a, gelu=gelu),
                 [None if t is None else t.detach().double().requires_grad_() for t in operands], grad_y.double())
    pytorch = _grads(lambda *a: reference.fftconv_fft(*a, gelu=gelu), operands, grad_y)
    poison_allocator(grad_y.device, 4 * grad_y.numel())
    ours = _grads(lambda *a: dispatch.fftconv(*a, gelu=gelu), operands, grad_y)
    names = [n for n, t in zip(("du", "dk", "dD", "dpregate", "dpostgate"), operands) if t is not None]
    for name, mine, theirs, exact, leaf in zip(names, ours, pytorch, ref, [t for t in operands if t is not None]):
        assert mine.dtype == leaf.dtype and mine.shape == leaf.shape, name
        err, torch_err = rel_err(mine, exact), rel_err(theirs, exact)
        floor = _dD_floor(operands, grad_y, gelu, exact) if name == "dD" else _float32_floor(leaf.dtype)
        assert err <= bound(max(torch_err, floor), leaf.dtype), f"{name}: error {err:.3g}, PyTorch's {torch_err:.3g}"


def _float32_floor(dtype: torch.dtype) -> float:
    """In float32 a gradient passes two or three transforms (the pre-activation's, FFT(g), the inverse), each
    rounding every value: one ulp of relative error (two unit roundoffs) is what any FFT path may show where
    PyTorch's happens to err less on a handful of outputs (L = 1, 14 values: the kernel 1.22e-7, PyTorch's
    rfft path 3.2e-8). In half precision the output's own rounding is larger and bound()'s floor holds."""
    return torch.finfo(torch.float32).eps if dtype == torch.float32 else 0.0


def _dD_floor(operands, grad_y, gelu, dD64):
    """dD = sum_{b,t} g v is H sums that cancel: relative errors of a few float32 roundings in g (which every
    FFT path has) move it by ~ eps ||g ⊙ v|| / |dD|, which may be far above PyTorch's luck on the same
    inputs; the kernel is held to 2x the larger of the two."""
    u, k, D, pre, post = _f64(*operands)
    c = reference.fftconv_fft(u, k, D, pre, None, False)
    g = grad_y.double() * (1.0 if post is None else post)
    if gelu:
        g = g * (0.5 * (1 + torch.erf(c / 2**0.5)) + c * torch.exp(-0.5 * c * c) / (2 * torch.pi) ** 0.5)
    v = u if pre is None else u * pre
    sensitivity = (g * v).square().sum(dim=(0, 2)).sum().sqrt() / dD64.norm()
    return 4 * torch.finfo(torch.float32).eps * sensitivity.item()


@pytest.mark.parametrize("L", [3000, 16384])
def test_training_step_transforms_the_filter_once(L):
    # the backward reuses the spectrum its forward computed (the issue: once per step, shared by the batch)
    u, k, D, pre, post = _operands(2, 3, L, L, torch.bfloat16, seed=11, requires_grad=True)
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
        dispatch.fftconv(u, k, D, pre, post, gelu=True).float().square().sum().backward()
        torch.cuda.synchronize()
    names = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert sum("spectrum_kernel" in n for n in names) == 1, sorted(set(names))
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in (u, k, D, pre, post))


@pytest.mark.parametrize("L", [700, 40000])
def test_backward_of_some_operands_only(L):
    u, k, D, pre, post = _operands(2, 3, L, L, torch.bfloat16, seed=3)
    k.requires_grad_()
    grad_y = torch.randn_like(u)
    (dk,) = torch.autograd.grad(dispatch.fftconv(u, k, D, pre, post, gelu=True), [k], grad_y)
    k64 = k.detach().double().requires_grad_()
    (exact,) = torch.autograd.grad(reference.fftconv_fft(*_f64(u), k64, *_f64(D, pre, post), gelu=True), [k64],
                                   grad_y.double())
    (theirs,) = torch.autograd.grad(reference.fftconv_fft(u, k, D, pre, post, gelu=True), [k], grad_y)
    assert rel_err(dk, exact) <= bound(rel_err(theirs, exact), torch.bfloat16)


# ---- the decoding step ----

@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("B,H,Lk,gelu", [(1, 768, 8192, True), (2, 7, 50, False), (3, 1, 1, True)])
def test_steps_equal_the_reference_step_and_the_full_op(B, H, Lk, gelu, dtype):
    L, Lmax = 300, 320
    u, k, D, pre, post = _operands(B, H, L, Lk, dtype, stable_seed("step", B, H, Lk, dtype))
    history = torch.full((B, H, Lmax), float("nan"), device="cuda", dtype=dtype)  # never read before written
    history_ref = history.clone()
    position = torch.zeros((), dtype=torch.int64, device="cuda")
    for t in range(L):
        pos = position if t % 2 else t
        y_t = dispatch.fftconv_step(history, u[:, :, t], k, pos, D, pre[:, :, t], post[:, :, t], gelu)
        y_ref = reference.fftconv_step(history_ref, u[:, :, t], k, t, D, pre[:, :, t], post[:, :, t], gelu)
        position += 1
        if t in (0, 1, L // 2, L - 1):
            exact = reference.fftconv_step(history_ref.double(), *_f64(u[:, :, t], k), t,
                                           *_f64(D, pre[:, :, t], post[:, :, t]), gelu)
            assert rel_err(y_t, exact) <= bound(rel_err(y_ref, exact), dtype), t
    assert torch.equal(history[:, :, :L], history_ref[:, :, :L])
    assert torch.isnan(history[:, :, L:]).all()
    full = _reference64(u, k, D, pre, post, gelu)[:, :, -1]
    assert rel_err(y_t, full) <= 8 * torch.finfo(dtype).eps


def test_step_out_of_range_device_position_gives_nan_and_writes_nothing():
    u, k, D, _, _ = _operands(2, 3, 1, 10, torch.float32, seed=4, gates=False)
    history = torch.randn(2, 3, 8, device="cuda")
    before = history.clone()
    y = dispatch.fftconv_step(history, u[:, :, 0], k, torch.tensor(8, device="cuda"), D)
    assert torch.isnan(y).all() and torch.equal(history, before)


# ---- torch.compile and CUDA graphs ----

def test_compile_fullgraph_forward_and_backward():
    u, k, D, pre, post = _operands(2, 7, 1500, 1500, torch.bfloat16, seed=5, requires_grad=True)

    def loss(u, k, D, pre, post):
        return dispatch.fftconv(u, k, D, pre, post, gelu=True).float().square().mean()

    compiled = torch.compile(loss, fullgraph=True)
    grads = torch.autograd.grad(compiled(u, k, D, pre, post), [u, k, D, pre, post])
    eager = torch.autograd.grad(loss(u, k, D, pre, post), [u, k, D, pre, post])
    for a, b in zip(grads, eager):
        assert rel_err(a, b.double()) < 1e-2


def test_compile_fullgraph_step_with_a_tensor_position():
    u, k, D, pre, post = _operands(2, 7, 40, 30, torch.float32, seed=6)
    history = torch.zeros(2, 7, 40, device="cuda")
    step = torch.compile(lambda h, x, p, a, b: dispatch.fftconv_step(h, x, k, p, D, a, b, gelu=True), fullgraph=True)
    history_ref = torch.zeros_like(history)
    for t in range(5):
        y = step(history, u[:, :, t], torch.tensor(t, device="cuda"), pre[:, :, t], post[:, :, t])
        y_ref = reference.fftconv_step(history_ref, u[:, :, t], k, t, D, pre[:, :, t], post[:, :, t], True)
        assert torch.allclose(y, y_ref, rtol=1e-5, atol=1e-5)


def _capture(fn):
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


@pytest.mark.parametrize("L", [3000, 40000])
def test_cuda_graph_capture_of_forward_and_backward(L):
    u, k, D, pre, post = _operands(2, 3, L, L, torch.bfloat16, seed=L, requires_grad=True)
    grad_y = torch.randn_like(u)

    def run():
        y = dispatch.fftconv(u, k, D, pre, post, gelu=True)
        return (y,) + torch.autograd.grad(y, [u, k, D, pre, post], grad_y)

    graph, outs = _capture(run)
    for seed in range(2):  # fresh inputs copied in, the graph replayed
        fresh = _operands(2, 3, L, L, torch.bfloat16, seed=100 + seed)
        with torch.no_grad():
            for t, f in zip((u, k, D, pre, post), fresh):
                t.copy_(f)
        graph.replay()
        expected = run()
        for got, want in zip(outs, expected):
            assert torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)


def test_cuda_graph_capture_of_the_step_with_a_device_position():
    B, H, Lmax = 1, 768, 512
    u, k, D, pre, post = _operands(B, H, Lmax, 400, torch.bfloat16, seed=7)
    history = torch.zeros(B, H, Lmax, device="cuda", dtype=torch.bfloat16)
    position = torch.zeros((), dtype=torch.int64, device="cuda")
    u_t, pre_t, post_t = u[:, :, 0].clone(), pre[:, :, 0].clone(), post[:, :, 0].clone()
    graph, y = _capture(lambda: dispatch.fftconv_step(history, u_t, k, position, D, pre_t, post_t, gelu=True))
    history.zero_()
    history_ref = torch.zeros_like(history)
    for t in range(20):
        u_t.copy_(u[:, :, t])
        pre_t.copy_(pre[:, :, t])
        post_t.copy_(post[:, :, t])
        position.fill_(t)
        graph.replay()
        y_ref = reference.fftconv_step(history_ref, u[:, :, t], k, t, D, pre[:, :, t], post[:, :, t], True)
        assert torch.allclose(y.float(), y_ref.float(), rtol=2e-2, atol=2e-2), t
    assert torch.equal(history[:, :, :20], history_ref[:, :, :20])


# ---- the bindings refuse what they do not take, naming it, before any launch ----

def _ext_args():
    u, k, D, pre, post = _operands(2, 3, 100, 50, torch.bfloat16, seed=8)
    return {"u": u, "k": k, "D": D, "pregate": pre, "postgate": post, "gelu": False, "spectrum": None}


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda a: {**a, "u": a["u"].cpu()}, ValueError, "u must be a CUDA tensor"),
        (lambda a: {**a, "u": a["u"][0]}, ValueError, "u must be 3-D"),
        (lambda a: {**a, "u": a["u"].double()}, TypeError, "u must be float16"),
        (lambda a: {**a, "u": a["u"].transpose(0, 1)}, ValueError, "u must be contiguous"),
        (lambda a: {**a, "k": a["k"][:2]}, ValueError, "k must be"),
        (lambda a: {**a, "k": a["k"].cpu()}, ValueError, "k is on cpu"),
        (lambda a: {**a, "k": a["k"].double()}, TypeError, "k must be float16"),
        (lambda a: {**a, "D": a["D"][:2]}, ValueError, "D must be"),
        (lambda a: {**a, "pregate": a["pregate"].float()}, TypeError, "pregate has dtype"),
        (lambda a: {**a, "postgate": a["postgate"][:, :, :99].contiguous()}, ValueError, "postgate must have"),
        (lambda a: {**a, "spectrum": torch.zeros(3, 10, dtype=torch.complex64, device="cuda")}, ValueError,
         "spectrum must be"),
    ],
)
def test_bindings_refuse_bad_operands(change, error, message):
    with pytest.raises(error, match=message):
        custom_ops.extension().fftconv_forward(**change(_ext_args()))


def test_step_binding_refuses_bad_operands():
    ext = custom_ops.extension()
    u = torch.randn(2, 3, device="cuda")
    k = torch.randn(3, 5, device="cuda")
    history = torch.zeros(2, 3, 8, device="cuda")
    with pytest.raises(ValueError, match="position must be in"):
        ext.fftconv_step(history, u, k, None, 8, None, None, None, False)
    with pytest.raises(TypeError, match="position must be a 0-d int64"):
        ext.fftconv_step(history, u, k, torch.tensor(1, device="cuda", dtype=torch.int32), 0, None, None, None, False)
    with pytest.raises(TypeError, match="history has dtype"):
        ext.fftconv_step(history.half(), u, k, None, 1, None, None, None, False)
    with pytest.raises(ValueError, match="history must be"):
        ext.fftconv_step(history[:1].contiguous(), u, k, None, 1, None, None, None, False)
