"""The mLSTM kernels against the float64 reference: each error at most 2x that of the PyTorch formulation
in the same dtype (the parallel form with its products in that dtype), outputs poisoned before each call,
NaN never passes. Forward, backward (q, k, v, both gates, the initial state), the recurrent step, states
carried between pieces, extreme gates, torch.compile and CUDA-graph capture, refused operands."""

from __future__ import annotations

import pytest
import torch

from bem.kernels.mlstm import custom_ops, mlstm, mlstm_step, mlstm_unavailable_reason, reference, selfcheck
from .kernel_helpers import bound, poison_allocator, rel_err, stable_seed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available() or custom_ops.extension() is None,
                       reason="needs a CUDA GPU and the mLSTM kernels"),
]


@pytest.fixture(autouse=True)
def kernels_without_first_use_check(monkeypatch):
    """The tests run the kernels themselves: a kernel that fails its first-use check must fail here, not
    step aside for the reference (test_first_use_check_passes runs the check)."""
    monkeypatch.setenv("BEM_MLSTM_SELFCHECK", "0")


def test_first_use_check_passes():
    assert selfcheck._check(custom_ops.extension(), torch.device("cuda")) is None
    assert mlstm_unavailable_reason(torch.empty(1, 1, 1, 1, device="cuda")) is None


def operands(B, NH, S, DK, DV, dtype, seed, gates=(-4.0, 6.0), requires_grad=False):
    """q, k, v ~ N(0, 1); igate uniform in [-4, 4], fgate uniform in `gates` (mostly open forget gates), or
    both uniform in `gates` when it is a pair of equal magnitudes."""
    g = torch.Generator(device="cuda").manual_seed(seed)

    def draw(*shape):
        return torch.randn(*shape, device="cuda", generator=g, dtype=torch.float32).to(dtype)

    def uniform(lo, hi):
        return (torch.rand(B, NH, S, device="cuda", generator=g) * (hi - lo) + lo).to(dtype)

    q, k, v = draw(B, NH, S, DK), draw(B, NH, S, DK), draw(B, NH, S, DV)
    if gates[0] == -gates[1]:
        i, f = uniform(*gates), uniform(*gates)
    else:
        i, f = uniform(-4.0, 4.0), uniform(*gates)
    return tuple(t.requires_grad_(requires_grad) for t in (q, k, v, i, f))


def random_state(B, NH, DK, DV, seed, requires_grad=False):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    C = torch.randn(B, NH, DK, DV, device="cuda", generator=g) * 0.3
    n = torch.randn(B, NH, DK, device="cuda", generator=g) * 0.3
    m = torch.randn(B, NH, device="cuda", generator=g)
    return tuple(t.requires_grad_(requires_grad) for t in (C, n, m))


def ref64(q, k, v, i, f, state=None):
    """The float64 oracle (chunkwise: the CPU tests show it equals the parallel form to 1e-13)."""
    st = None if state is None else tuple(t.double() for t in state)
    return reference.mlstm_chunkwise(q.double(), k.double(), v.double(), i.double(), f.double(), st, True)


def torch_formulation(q, k, v, i, f, state=None):
    """The PyTorch formulation in the inputs' dtype: the yardstick of the error bound."""
    return reference.mlstm_parallel(q, k, v, i, f, state, True)


def kernel(*args, **kwargs):
    poison_allocator(torch.device("cuda"), args[0].numel() * 8)
    return mlstm(*args, **kwargs)


FORWARD_CASES = (
    [(torch.bfloat16, S, 64, 64) for S in (1, 2, 15, 16, 100, 1000, 4097)]
    + [(torch.bfloat16, 100, dk, dv) for dk, dv in ((16, 16), (64, 128), (100, 100), (128, 64), (256, 256))]
    + [(torch.float16, S, 128, 128) for S in (15, 1000)]
    + [(torch.float16, 100, 100, 48)]
    + [(torch.float32, S, 64, 64) for S in (2, 100)]
    + [(torch.float32, 130, 100, 256)]
)


@pytest.mark.parametrize("dtype,S,DK,DV", FORWARD_CASES)
def test_forward_matches_float64(dtype, S, DK, DV):
    B, NH = 2, 3
    seed = stable_seed("fwd", dtype, S, DK, DV)
    q, k, v, i, f = operands(B, NH, S, DK, DV, dtype, seed)
    state = random_state(B, NH, DK, DV, seed) if S in (15, 100) else None
    with torch.no_grad():
        h, last = kernel(q, k, v, i, f, initial_state=state, return_last_state=True)
        h_ref, last_ref = ref64(q, k, v, i, f, state)
        h_torch, last_torch = torch_formulation(q, k, v, i, f, state)
    assert h.dtype == dtype and h.shape == (B, NH, S, DV)
    err, torch_err = rel_err(h, h_ref), rel_err(h_torch, h_ref)
    assert err <= bound(torch_err, dtype), f"h: kernel {err:.2e}, PyTorch {torch_err:.2e}"
    for name, got, want, yard in zip("Cnm", last, last_ref, last_torch):
        assert got.dtype == torch.float32
        err, torch_err = rel_err(got, want), rel_err(yard, want)
        assert err <= bound(torch_err, dtype), f"last state {name}: kernel {err:.2e}, PyTorch {torch_err:.2e}"


@pytest.mark.parametrize("dtype,S,DK,DV", [(torch.bfloat16, 200, 64, 32), (torch.float32, 129, 72, 64)])
def test_chunk_states_match_the_reference(dtype, S, DK, DV):
    """The kernels' intermediate quantities (what the backward reuses) against the reference's."""
    seed = stable_seed("states", dtype, S)
    q, k, v, i, f = operands(2, 2, S, DK, DV, dtype, seed)
    with torch.no_grad():
        got = custom_ops.extension().mlstm_forward(q, k, v, i, f)
        want = reference.chunkwise(q.double(), k.double(), v.double(), i.double(), f.double(), None, 64)
    names = ["m_tok", "den_tok", "C_states", "n_states", "m_states"]
    for name, a, b in zip(names, got[4:], (want.m, want.den, want.C_states, want.n_states, want.m_states)):
        assert a.shape == b.shape, name
        tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
        assert rel_err(a, b) < tol, f"{name}: {rel_err(a, b):.2e}"


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_every_state_width_gives_the_same_bits(dtype):
    """The state pass owns 16, 32 or 64 columns of DV a block (picked by the grid): each state element is
    summed in the same order whatever the width, so forward and backward agree to the bit across widths.
    DV 100 leaves a partial tile at every width; DK 72 a partial one of 64 rows."""
    ext = custom_ops.extension()
    B, NH, S, DK, DV = 2, 3, 150, 72, 100
    seed = stable_seed("widths", dtype)
    q, k, v, i, f = operands(B, NH, S, DK, DV, dtype, seed)
    C0, n0, m0 = random_state(B, NH, DK, DV, seed)
    dh = torch.randn(B, NH, S, DV, device="cuda", dtype=torch.float32).to(dtype)
    dC, dn = torch.randn_like(C0), torch.randn_like(n0)
    results = {}
    for cols in (16, 32, 64):
        poison_allocator(torch.device("cuda"), q.numel() * 8)
        fwd = ext.mlstm_forward(q, k, v, i, f, C0, n0, m0, state_cols=cols)
        h, _, _, _, m_tok, den_tok, C_states, n_states, m_states = fwd
        beta = ext.mlstm_beta(dh, h, m_tok, den_tok)
        bwd = ext.mlstm_backward(dh, q, k, v, i, f, m_tok, den_tok, beta, C_states, n_states, m_states, dC, dn,
                                 state_cols=cols)
        results[cols] = list(fwd) + [beta] + list(bwd)
    for got in results.values():
        assert all(torch.isfinite(t).all() for t in got)
    for cols in (32, 64):
        for index, (a, b) in enumerate(zip(results[cols], results[16])):
            assert torch.equal(a, b), f"output {index} differs between state widths {cols} and 16"
    with torch.no_grad():
        h_ref, last_ref = ref64(q, k, v, i, f, (C0, n0, m0))
        h_torch, _ = torch_formulation(q, k, v, i, f, (C0, n0, m0))
    err, torch_err = rel_err(results[16][0], h_ref), rel_err(h_torch, h_ref)
    assert err <= bound(torch_err, dtype), f"h: kernel {err:.2e}, PyTorch {torch_err:.2e}"


@pytest.mark.parametrize("dtype,DV", [(torch.bfloat16, 64), (torch.float16, 100), (torch.float32, 37)])
def test_beta_kernel_matches_float64(dtype, DV):
    """beta = -(dh·h) / n · sign(den) where |den| > exp(-m), else 0: the kernel against float64, with both
    sides of the threshold drawn (16-byte loads at DV 64 and 100 in 16-bit, scalar loads at DV 37)."""
    ext = custom_ops.extension()
    g = torch.Generator(device="cuda").manual_seed(stable_seed("beta", dtype, DV))
    B, NH, S = 2, 3, 77
    dh = torch.randn(B, NH, S, DV, device="cuda", generator=g).to(dtype)
    h = torch.randn(B, NH, S, DV, device="cuda", generator=g).to(dtype)
    m_tok = torch.randn(B, NH, S, device="cuda", generator=g) * 3
    den_tok = torch.randn(B, NH, S, device="cuda", generator=g) * torch.exp(-m_tok) * 2
    poison_allocator(torch.device("cuda"), dh.numel())
    got = ext.mlstm_beta(dh, h, m_tok, den_tok)
    den, m = den_tok.double(), m_tok.double()
    n = torch.maximum(den.abs(), torch.exp(-m))
    dot = (dh.double() * h.double()).sum(-1)
    want = torch.where(den.abs() > torch.exp(-m), -dot / n * torch.sign(den), torch.zeros_like(dot))
    assert ((den.abs() > torch.exp(-m)).float().mean() - 0.5).abs() < 0.4  # both branches drawn
    assert rel_err(got, want) < (1e-5 if dtype == torch.float32 else 1e-3)


def _loss_weights(h, last, seed):
    g = torch.Generator(device="cuda").manual_seed(seed + 2)
    dh = torch.randn(h.shape, device="cuda", generator=g).to(h.dtype)
    dC = torch.randn(last[0].shape, device="cuda", generator=g)
    dn = torch.randn(last[1].shape, device="cuda", generator=g)
    return dh, dC, dn


def _grads(fn, inputs, weights):
    h, last = fn(*inputs)
    dh, dC, dn = weights
    # the last m weighted so the loss reads the true state exp(m) (C, n), as a next piece does
    dm = ((last[0].double() * dC.double()).sum((-1, -2)) + (last[1].double() * dn.double()).sum(-1)).detach()
    loss = ((h.double() * dh.double()).sum() + (last[0].double() * dC.double()).sum()
            + (last[1].double() * dn.double()).sum() + (last[2].double() * dm).sum())
    return torch.autograd.grad(loss, inputs)


BACKWARD_CASES = [
    (torch.bfloat16, 1, 64, 64), (torch.bfloat16, 100, 64, 64), (torch.bfloat16, 1000, 64, 64),
    (torch.bfloat16, 77, 128, 256), (torch.float16, 100, 128, 128), (torch.float32, 70, 100, 64),
]


@pytest.mark.parametrize("dtype,S,DK,DV", BACKWARD_CASES)
def test_backward_matches_float64(dtype, S, DK, DV):
    B, NH = 2, 2
    seed = stable_seed("bwd", dtype, S, DK, DV)
    q, k, v, i, f = operands(B, NH, S, DK, DV, dtype, seed, requires_grad=True)
    state = random_state(B, NH, DK, DV, seed, requires_grad=True)
    inputs = (q, k, v, i, f, *state)
    with torch.no_grad():
        weights = _loss_weights(*ref64(q, k, v, i, f, state), seed)

    def run_kernel(q, k, v, i, f, C, n, m):
        poison_allocator(torch.device("cuda"), q.numel() * 8)
        return mlstm(q, k, v, i, f, initial_state=(C, n, m), return_last_state=True)

    def run_ref(q, k, v, i, f, C, n, m):
        return ref64(q, k, v, i, f, (C, n, m))

    def run_torch(q, k, v, i, f, C, n, m):
        return torch_formulation(q, k, v, i, f, (C, n, m))

    got = _grads(run_kernel, inputs, weights)
    want = _grads(run_ref, inputs, weights)
    yard = _grads(run_torch, inputs, weights)
    names = ["dq", "dk", "dv", "digate", "dfgate", "dC0", "dn0", "dm0"]
    failures = []
    for name, a, b, c in zip(names, got, want, yard):
        err, torch_err = rel_err(a, b), rel_err(c, b)
        if not err <= bound(torch_err, dtype):
            failures.append(f"{name}: kernel {err:.2e}, PyTorch {torch_err:.2e}")
    assert not failures, "; ".join(failures)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("gates", ["uniform", "open_forget_tiny_input", "closed_forget_huge_input"])
def test_extreme_gates_no_nan(dtype, gates):
    B, NH, S, D = 1, 2, 4097, 64
    seed = stable_seed("extreme", dtype, gates)
    q, k, v, i, f = operands(B, NH, S, D, D, dtype, seed, gates=(-30.0, 30.0))
    if gates != "uniform":
        i_val, f_val = (-30.0, 30.0) if gates == "open_forget_tiny_input" else (30.0, -30.0)
        i, f = torch.full_like(i, i_val), torch.full_like(f, f_val)
    for t in (q, k, v, i, f):
        t.requires_grad_(True)
    h, last = kernel(q, k, v, i, f, return_last_state=True)
    assert torch.isfinite(h).all() and all(torch.isfinite(t).all() for t in last)
    grads = torch.autograd.grad(h.float().square().sum(), (q, k, v, i, f))
    # Gates this extreme make some true gradients larger than float16 can hold (1e8-3e9 against 65504, in a
    # float64 check of these distributions): there the dtype's answer is inf. NaN is never right, and a
    # gradient the dtype can hold must come out finite.
    h_ref, _ = ref64(q, k, v, i, f)
    grads_ref = torch.autograd.grad(h_ref.square().sum(), (q, k, v, i, f))
    for name, got, want in zip(("dq", "dk", "dv", "digate", "dfgate"), grads, grads_ref):
        assert not torch.isnan(got).any(), name
        representable = want.abs() < torch.finfo(dtype).max / 2
        assert torch.isfinite(got[representable]).all(), name
    h_ref = h_ref.detach()
    # what the dtype can hold at all (outputs near 1e-13 underflow in float16) plus bf16-level error
    floor = (h_ref - h_ref.to(dtype).double()).norm()
    assert (h.double() - h_ref).norm() <= 0.02 * h_ref.norm() + 2 * floor


@pytest.mark.parametrize("dtype,DK,DV", [(torch.bfloat16, 128, 64), (torch.float32, 48, 100), (torch.float16, 64, 64)])
def test_step_kernel_equals_parallel(dtype, DK, DV):
    B, NH, S = 2, 4, 33
    seed = stable_seed("step", dtype, DK, DV)
    q, k, v, i, f = operands(B, NH, S, DK, DV, dtype, seed)
    state = random_state(B, NH, DK, DV, seed)
    hs, st = [], state
    with torch.no_grad():
        for t in range(S):
            poison_allocator(torch.device("cuda"), 1 << 16)
            h, st = mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t], f[:, :, t], st)
            hs.append(h)
        h_ref, last_ref = ref64(q, k, v, i, f, state)
        h_torch, last_torch = torch_formulation(q, k, v, i, f, state)
    err, torch_err = rel_err(torch.stack(hs, 2), h_ref), rel_err(h_torch, h_ref)
    assert err <= bound(torch_err, dtype), f"h: step kernel {err:.2e}, PyTorch {torch_err:.2e}"
    for name, a, b, c in zip("Cnm", st, last_ref, last_torch):
        err, torch_err = rel_err(a, b), rel_err(c, b)
        assert err <= bound(torch_err, dtype), f"{name}: step kernel {err:.2e}, PyTorch {torch_err:.2e}"


@pytest.mark.parametrize("dtype,S,split", [(torch.bfloat16, 300, 129), (torch.float32, 100, 37)])
def test_two_pieces_with_carried_state_equal_one(dtype, S, split):
    seed = stable_seed("pieces", dtype, S)
    q, k, v, i, f = operands(2, 2, S, 64, 96, dtype, seed)
    with torch.no_grad():
        h_one, last_one = kernel(q, k, v, i, f, return_last_state=True)
        first = [t[:, :, :split] for t in (q, k, v, i, f)]
        second = [t[:, :, split:] for t in (q, k, v, i, f)]
        h_a, mid = kernel(*first, return_last_state=True)
        h_b, last_two = kernel(*second, initial_state=mid, return_last_state=True)
        h_ref, last_ref = ref64(q, k, v, i, f)
        h_torch, _ = torch_formulation(q, k, v, i, f)
    err, torch_err = rel_err(torch.cat([h_a, h_b], 2), h_ref), rel_err(h_torch, h_ref)
    assert err <= bound(torch_err, dtype), f"two pieces {err:.2e}, PyTorch {torch_err:.2e}"
    assert rel_err(h_one, h_ref) <= bound(torch_err, dtype)
    for a, b in zip(last_two, last_one):
        assert rel_err(a, b.double()) < (2e-2 if dtype == torch.bfloat16 else 1e-5)


def test_step_under_cuda_graph_and_compile():
    B, NH, D = 1, 8, 128
    q, k, v, i, f = operands(B, NH, 4, D, D, torch.bfloat16, stable_seed("graph"))
    state = reference.zero_state(B, NH, D, D, device="cuda")
    with torch.no_grad():
        h_eager, st_eager = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], state)
        static = [t[:, :, 0].clone() for t in (q, k, v, i, f)]
        static_state = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            mlstm_step(*static, static_state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            h_graph, st_graph = mlstm_step(*static, static_state)
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(h_graph, h_eager) and all(torch.equal(a, b) for a, b in zip(st_graph, st_eager))
        compiled = torch.compile(mlstm_step, fullgraph=True)
        h_c, st_c = compiled(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], state)
        assert rel_err(h_c, h_eager.double()) < 1e-6


def test_compile_fullgraph_forward_and_backward():
    q, k, v, i, f = operands(2, 2, 150, 64, 64, torch.bfloat16, stable_seed("compile"), requires_grad=True)

    def loss(q, k, v, i, f):
        return mlstm(q, k, v, i, f).float().square().sum()

    compiled = torch.compile(loss, fullgraph=True)
    got = torch.autograd.grad(compiled(q, k, v, i, f), (q, k, v, i, f))
    want = torch.autograd.grad(loss(q, k, v, i, f), (q, k, v, i, f))
    for a, b in zip(got, want):
        assert rel_err(a, b.double()) < 1e-3


def test_bad_operands_refused_in_cpp():
    ext = custom_ops.extension()
    q, k, v, i, f = operands(1, 2, 10, 16, 8, torch.bfloat16, 0)
    cases = {
        "k must be": (q, k[..., :8].contiguous(), v, i, f),
        "v must be": (q, k, v[:, :1].contiguous(), i, f),
        "igate must be": (q, k, v, i[..., :5].contiguous(), f),
        "fgate must have": (q, k, v, i.float(), f.half()),
        "k has dtype": (q, k.float(), v, i, f),
        "q must be contiguous": (q.transpose(2, 3), k, v, i, f),
        "q must be a CUDA tensor": (q.cpu(), k, v, i, f),
    }
    for message, args in cases.items():
        with pytest.raises(ValueError, match=message):
            ext.mlstm_forward(*args)
    with pytest.raises(ValueError, match="initial_state C"):
        ext.mlstm_forward(q, k, v, i, f, torch.zeros(1, 2, 16, 9, device="cuda"), torch.zeros(1, 2, 16, device="cuda"),
                          torch.zeros(1, 2, device="cuda"))
    state = reference.zero_state(1, 2, 16, 8, device="cuda")
    with pytest.raises(ValueError, match="state C must be float32"):
        ext.mlstm_step(q[:, :, 0].contiguous(), k[:, :, 0].contiguous(), v[:, :, 0].contiguous(),
                       i[:, :, 0].contiguous(), f[:, :, 0].contiguous(), state[0].half(), state[1], state[2])
    with pytest.raises(ValueError, match="q must be 3-D"):
        ext.mlstm_step(q, k, v, i, f, *state)
    with pytest.raises(ValueError, match="float16, bfloat16 or float32"):
        ext.mlstm_forward(q.double(), k.double(), v.double(), i.double(), f.double())
    with pytest.raises(ValueError, match="state_cols must be 0, 16, 32 or 64, got 48"):
        ext.mlstm_forward(q, k, v, i, f, state_cols=48)
    m_tok = torch.zeros(1, 2, 10, device="cuda")
    with pytest.raises(ValueError, match="dh must be"):
        ext.mlstm_beta(v[..., :-1].contiguous(), v, m_tok, m_tok)
    with pytest.raises(ValueError, match="den_tok must be float32"):
        ext.mlstm_beta(v, v, m_tok, m_tok.half())
