"""The mLSTM reference formulations against each other (float64, CPU): parallel, chunkwise at several chunk
sizes and the recurrent step; states carried between pieces; extreme gates in float16 / bfloat16; causality;
the backward written out chunkwise against autograd; the custom ops' contract on CPU; refused inputs."""

from __future__ import annotations

import zlib

import pytest
import torch

from bem.kernels.mlstm import custom_ops, mlstm, mlstm_step, mlstm_unavailable_reason, reference
from bem.kernels.mlstm.backward import chunkwise_backward, initial_state_grad


def _gen(*parts) -> torch.Generator:
    return torch.Generator().manual_seed(zlib.crc32(repr(parts).encode()))


def _operands(B, NH, S, DK, DV, gen, dtype=torch.float64, gate_scale=3.0, requires_grad=False):
    def draw(*shape, scale=1.0):
        t = (torch.randn(*shape, generator=gen, dtype=torch.float64) * scale).to(dtype)
        return t.requires_grad_(requires_grad)

    return (draw(B, NH, S, DK), draw(B, NH, S, DK), draw(B, NH, S, DV), draw(B, NH, S, scale=gate_scale),
            draw(B, NH, S, scale=gate_scale))


def _state(B, NH, DK, DV, gen, requires_grad=False):
    C = torch.randn(B, NH, DK, DV, generator=gen, dtype=torch.float64)
    n = torch.randn(B, NH, DK, generator=gen, dtype=torch.float64)
    m = torch.randn(B, NH, generator=gen, dtype=torch.float64)
    return tuple(t.requires_grad_(requires_grad) for t in (C, n, m))


def _steps(q, k, v, i, f, state):
    hs = []
    for t in range(q.shape[2]):
        h, state = reference.mlstm_step(q[:, :, t], k[:, :, t], v[:, :, t], i[:, :, t], f[:, :, t], state)
        hs.append(h)
    return torch.stack(hs, 2), state


def _close(a, b, tol=1e-10):
    assert torch.isfinite(a).all()
    err = ((a - b).norm() / b.norm().clamp_min(1e-300)).item()
    assert err < tol, err


@pytest.mark.parametrize("S", [1, 2, 7, 33, 100, 257])
def test_forms_agree(S):
    B, NH, DK, DV = 2, 2, 8, 5
    q, k, v, i, f = _operands(B, NH, S, DK, DV, _gen("forms", S))
    h_par, last_par = reference.mlstm_parallel(q, k, v, i, f, return_last_state=True)
    for chunk in (1, 4, 16, 64):
        h_chunk, last_chunk = reference.mlstm_chunkwise(q, k, v, i, f, return_last_state=True, chunk_size=chunk)
        _close(h_chunk, h_par)
        for a, b in zip(last_chunk, last_par):
            _close(a, b)
    if S > 100:
        return  # the step S times: up to 100 tokens keeps the suite fast
    h_step, last_step = _steps(q, k, v, i, f, reference.zero_state(B, NH, DK, DV, dtype=torch.float64))
    _close(h_step, h_par)
    for a, b in zip(last_step, last_par):
        _close(a, b)


def test_forms_differ_from_a_plain_causal_average():
    """The gates matter: with the input gate of one token raised, every later output moves."""
    q, k, v, i, f = _operands(1, 1, 12, 4, 4, _gen("gates"))
    h = reference.mlstm_parallel(q, k, v, i, f)
    i2 = i.clone()
    i2[..., 5] += 4.0
    h2 = reference.mlstm_parallel(q, k, v, i2, f)
    assert torch.equal(h[..., :5, :], h2[..., :5, :])
    assert ((h[..., 5:, :] - h2[..., 5:, :]).abs().amax(-1) > 1e-6).all()


@pytest.mark.parametrize("S,split", [(40, 17), (130, 64), (9, 1)])
def test_two_pieces_with_carried_state_equal_one(S, split):
    B, NH, DK, DV = 2, 3, 6, 10
    gen = _gen("pieces", S, split)
    q, k, v, i, f = _operands(B, NH, S, DK, DV, gen)
    init = _state(B, NH, DK, DV, gen)
    h_one, last_one = reference.mlstm_parallel(q, k, v, i, f, init, return_last_state=True)
    parts = [slice(0, split), slice(split, S)]
    h_a, mid = reference.mlstm_chunkwise(*(t[:, :, parts[0]] for t in (q, k, v, i, f)), init, True, chunk_size=16)
    h_b, last_two = reference.mlstm_chunkwise(*(t[:, :, parts[1]] for t in (q, k, v, i, f)), mid, True, chunk_size=7)
    _close(torch.cat([h_a, h_b], 2), h_one)
    for a, b in zip(last_two, last_one):
        _close(a, b)
    h_steps, last_steps = _steps(q, k, v, i, f, init)
    _close(h_steps, h_one)
    _close(last_steps[0], last_one[0])


def test_initial_state_none_is_the_zero_state():
    q, k, v, i, f = _operands(1, 2, 20, 4, 3, _gen("zero"))
    zero = reference.zero_state(1, 2, 4, 3, dtype=torch.float64)
    h_none, last_none = reference.mlstm_parallel(q, k, v, i, f, return_last_state=True)
    h_zero, last_zero = reference.mlstm_chunkwise(q, k, v, i, f, zero, True, chunk_size=8)
    _close(h_zero, h_none)
    for a, b in zip(last_zero, last_none):
        _close(a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("pattern", ["uniform", "open_forget_tiny_input", "closed_forget_huge_input"])
def test_extreme_gates_stay_finite(dtype, pattern):
    B, NH, S, DK, DV = 1, 2, 130, 16, 8
    gen = _gen("extreme", str(dtype), pattern)
    q, k, v, _, _ = _operands(B, NH, S, DK, DV, gen)
    if pattern == "uniform":
        i = torch.rand(B, NH, S, generator=gen, dtype=torch.float64) * 60 - 30
        f = torch.rand(B, NH, S, generator=gen, dtype=torch.float64) * 60 - 30
    elif pattern == "open_forget_tiny_input":
        i, f = torch.full((B, NH, S), -30.0, dtype=torch.float64), torch.full((B, NH, S), 30.0, dtype=torch.float64)
    else:
        i, f = torch.full((B, NH, S), 30.0, dtype=torch.float64), torch.full((B, NH, S), -30.0, dtype=torch.float64)
    low = [t.to(dtype) for t in (q, k, v, i, f)]
    ref = reference.mlstm_parallel(*(t.double() for t in low))
    # what the dtype can hold at all: outputs near 1e-13 (an input gate of -30) underflow in float16
    floor = (ref - ref.to(dtype).double()).norm()
    h_par = reference.mlstm_parallel(*low)
    h_chunk, last = reference.mlstm_chunkwise(*low, return_last_state=True, chunk_size=64)
    h_step, last_step = _steps(*low, reference.zero_state(B, NH, DK, DV))
    for h in (h_par, h_chunk, h_step):
        assert h.dtype == dtype and torch.isfinite(h).all()
        assert (h.double() - ref).norm() <= 0.05 * ref.norm() + 2 * floor
    for t in (*last, *last_step):
        assert torch.isfinite(t).all()


def test_causal():
    q, k, v, i, f = _operands(1, 2, 50, 8, 8, _gen("causal"))
    h = reference.mlstm_chunkwise(q, k, v, i, f, chunk_size=16)
    for t in (0, 15, 16, 31, 48):
        changed = [x.clone() for x in (q, k, v, i, f)]
        for x in changed:
            x[:, :, t + 1:] = torch.randn_like(x[:, :, t + 1:])
        h2 = reference.mlstm_chunkwise(*changed, chunk_size=16)
        assert torch.equal(h[:, :, :t + 1], h2[:, :, :t + 1])
        assert not torch.equal(h[:, :, t + 1:], h2[:, :, t + 1:])


def _loss_weights(h, last, gen):
    """Random weights for h and the last state, with the last m's weight set so the loss depends on the
    true state exp(m) (C, n) only: as the next piece of a sequence uses it."""
    dh = torch.randn(h.shape, generator=gen, dtype=torch.float64)
    dC = torch.randn(last[0].shape, generator=gen, dtype=torch.float64)
    dn = torch.randn(last[1].shape, generator=gen, dtype=torch.float64)
    dm = ((last[0] * dC).sum((-1, -2)) + (last[1] * dn).sum(-1)).detach()
    return dh, dC, dn, dm


@pytest.mark.parametrize("S,chunk", [(1, 4), (37, 16), (64, 64), (100, 64)])
def test_chunkwise_backward_matches_autograd(S, chunk):
    B, NH, DK, DV = 2, 2, 8, 5
    gen = _gen("backward", S, chunk)
    q, k, v, i, f = _operands(B, NH, S, DK, DV, gen, requires_grad=True)
    init = _state(B, NH, DK, DV, gen, requires_grad=True)
    h, last = reference.mlstm_parallel(q, k, v, i, f, init, return_last_state=True)
    dh, dC, dn, dm = _loss_weights(h, last, gen)
    loss = (h * dh).sum() + (last[0] * dC).sum() + (last[1] * dn).sum() + (last[2] * dm).sum()
    expected = torch.autograd.grad(loss, [q, k, v, i, f, *init])
    with torch.no_grad():
        out = reference.chunkwise(q, k, v, i, f, init, chunk)
        dq, dk, dv, di, df, dC0, dn0 = chunkwise_backward(dh, q, k, v, i, f, out.h, out.m, out.den, out.C_states,
                                                          out.n_states, out.m_states, chunk, out.last, (dC, dn))
        dm0 = initial_state_grad(dC0, dn0, init[0], init[1])
    for got, want in zip((dq, dk, dv, di, df, dC0, dn0, dm0), expected):
        _close(got, want, 1e-9)


def test_custom_op_autograd_matches_reference():
    """The custom op's own backward (the PyTorch contract on CPU), with any weight on the last state's m."""
    B, NH, S, DK, DV = 2, 2, 70, 8, 12
    gen = _gen("custom-op")
    q, k, v, i, f = _operands(B, NH, S, DK, DV, gen, requires_grad=True)
    init = _state(B, NH, DK, DV, gen, requires_grad=True)
    h, last = reference.mlstm_parallel(q, k, v, i, f, init, return_last_state=True)
    dh, dC, dn, _ = _loss_weights(h, last, gen)
    dm = torch.randn(last[2].shape, generator=gen, dtype=torch.float64)
    weights = (dh, dC, dn, dm)
    expected = torch.autograd.grad(sum((t * w).sum() for t, w in zip((h, *last), weights)), [q, k, v, i, f, *init])
    out = custom_ops.mlstm_chunkwise_fwd(q, k, v, i, f, *init)
    got = torch.autograd.grad(sum((t * w).sum() for t, w in zip(out[:4], weights)), [q, k, v, i, f, *init])
    for a, b in zip(got, expected):
        _close(a, b, 1e-9)


def test_custom_ops_fake_implementations():
    gen = _gen("opcheck")
    q, k, v, i, f = _operands(1, 1, 5, 3, 2, gen)
    init = _state(1, 1, 3, 2, gen)
    checks = ("test_schema", "test_faketensor")
    torch.library.opcheck(custom_ops.mlstm_chunkwise_fwd, (q, k, v, i, f, *init), test_utils=checks)
    out = custom_ops.mlstm_chunkwise_fwd(q, k, v, i, f, *init)
    dh = torch.randn(out[0].shape, generator=gen, dtype=torch.float64)
    torch.library.opcheck(custom_ops.mlstm_chunkwise_bwd,
                          (dh, q, k, v, i, f, out[0], *out[4:], out[1], out[2], torch.ones_like(out[1]), None),
                          test_utils=checks)
    torch.library.opcheck(custom_ops.mlstm_step, (q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], *init),
                          test_utils=checks)


def test_custom_op_compiles_fullgraph():
    gen = _gen("compile")
    q, k, v, i, f = _operands(1, 2, 10, 8, 4, gen, dtype=torch.float32, requires_grad=True)

    def loss(q, k, v, i, f):
        return custom_ops.mlstm_chunkwise_fwd(q, k, v, i, f, None, None, None)[0].square().sum()

    compiled = torch.compile(loss, fullgraph=True, backend="eager")
    got = torch.autograd.grad(compiled(q, k, v, i, f), [q, k, v, i, f])
    want = torch.autograd.grad(loss(q, k, v, i, f), [q, k, v, i, f])
    for a, b in zip(got, want):
        assert torch.allclose(a, b)


def test_dispatch_on_cpu_runs_the_reference_and_says_why():
    q, k, v, i, f = _operands(1, 1, 5, 4, 4, _gen("dispatch"), dtype=torch.float32)
    assert "cpu" in mlstm_unavailable_reason(q)
    assert mlstm_unavailable_reason(q, use_fused=False) == "use_fused is False"
    h, state = mlstm(q, k, v, i, f, return_last_state=True)
    assert torch.equal(h, reference.mlstm_chunkwise(q, k, v, i, f))
    h1, state1 = mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], state)
    assert h1.shape == (1, 1, 4) and state1[0].dtype == torch.float32


def test_bad_inputs_are_refused_naming_the_operand():
    q, k, v, i, f = _operands(2, 2, 6, 4, 3, _gen("bad"))
    bad = {
        "k": (q, k[..., :3], v, i, f),
        "v": (q, k, v[:, :1], i, f),
        "igate": (q, k, v, i[..., :5], f),
        "fgate": (q, k, v, i, f[None]),
        "q must be 4-D": (q[0], k, v, i, f),
    }
    for name, args in bad.items():
        with pytest.raises(ValueError, match=name):
            mlstm(*args)
        with pytest.raises(ValueError, match=name):
            reference.mlstm_parallel(*args)
    with pytest.raises(TypeError, match="k has dtype"):
        mlstm(q, k.float(), v, i, f)
    with pytest.raises(ValueError, match="initial_state C"):
        mlstm(q, k, v, i, f, initial_state=(torch.zeros(2, 2, 4, 4), torch.zeros(2, 2, 4), torch.zeros(2, 2)))
    with pytest.raises(ValueError, match="initial_state m"):
        mlstm(q, k, v, i, f, initial_state=(torch.zeros(2, 2, 4, 3), torch.zeros(2, 2, 4), torch.zeros(2)))
    with pytest.raises(TypeError, match="q must be a torch.Tensor"):
        mlstm(None, k, v, i, f)
    with pytest.raises(ValueError, match="chunk_size"):
        reference.mlstm_chunkwise(q, k, v, i, f, chunk_size=0)
    state = reference.zero_state(2, 2, 4, 3)
    with pytest.raises(ValueError, match="q must be 3-D"):
        mlstm_step(q, k, v, i, f, state)
    with pytest.raises(ValueError, match="state n"):
        mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], (state[0], state[1][..., :2], state[2]))
    with pytest.raises(ValueError, match="state must be"):
        mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], i[:, :, 0], f[:, :, 0], None)
