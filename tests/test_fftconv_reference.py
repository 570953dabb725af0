"""The fftconv reference on the CPU: the FFT path against the direct causal sum, the decoding step against
the full op, causality, and the argument checks (float64 unless a test is about dtypes)."""

from __future__ import annotations

import pytest
import torch

from bem.kernels.fftconv import reference

F64 = torch.float64


def _operands(B, H, L, Lk, seed, dtype=F64, gates=True, D=True):
    g = torch.Generator().manual_seed(seed)
    u = torch.randn(B, H, L, generator=g, dtype=F64).to(dtype)
    k = (torch.randn(H, Lk, generator=g, dtype=F64) / max(1, Lk) ** 0.5).to(dtype)
    d = torch.randn(H, generator=g, dtype=F64).to(dtype) if D else None
    pre = torch.randn(B, H, L, generator=g, dtype=F64).to(dtype) if gates else None
    post = torch.randn(B, H, L, generator=g, dtype=F64).to(dtype) if gates else None
    return u, k, d, pre, post


def _loop(u, k, D, pre, post, gelu):
    """The definition, one output at a time (tiny sizes only)."""
    B, H, L = u.shape
    v = u if pre is None else u * pre
    y = torch.zeros_like(u)
    for t in range(L):
        for s in range(t + 1):
            if t - s < k.shape[1]:
                y[:, :, t] += k[:, t - s] * v[:, :, s]
    if D is not None:
        y = y + D[:, None] * v
    if gelu:
        y = 0.5 * y * (1 + torch.erf(y / 2**0.5))
    return y if post is None else y * post


def test_direct_sum_is_the_definition():
    u, k, D, pre, post = _operands(2, 3, 9, 5, seed=1)
    expected = _loop(u, k, D, pre, post, gelu=True)
    assert torch.allclose(reference.fftconv_direct(u, k, D, pre, post, gelu=True), expected, atol=1e-12)


@pytest.mark.parametrize("L", [1, 2, 7, 33, 100, 257])
@pytest.mark.parametrize("taps", ["L", "fewer", "more"])
@pytest.mark.parametrize("extras", [(False, False, False), (True, False, True), (True, True, True)])
def test_fft_equals_direct(L, taps, extras):
    D_on, gates, gelu = extras
    Lk = {"L": L, "fewer": max(1, L // 3), "more": L + 4}[taps]
    u, k, D, pre, post = _operands(2, 3, L, Lk, seed=L * 7 + Lk, gates=gates, D=D_on)
    fft = reference.fftconv_fft(u, k, D, pre, post, gelu)
    direct = reference.fftconv_direct(u, k, D, pre, post, gelu)
    assert fft.shape == u.shape and fft.dtype == F64
    scale = direct.abs().max().clamp_min(1e-12)
    assert ((fft - direct).abs().max() / scale).item() < 1e-12


def test_taps_past_L_do_not_matter_and_missing_taps_are_zero():
    u, k, D, pre, post = _operands(1, 2, 12, 20, seed=3)
    same = torch.cat([k[:, :12], torch.randn(2, 8, dtype=F64)], dim=1)
    assert torch.allclose(reference.fftconv_fft(u, k, D), reference.fftconv_fft(u, same, D))
    padded = torch.cat([k[:, :5], torch.zeros(2, 7, dtype=F64)], dim=1)
    assert torch.allclose(reference.fftconv_fft(u, k[:, :5], D), reference.fftconv_fft(u, padded, D))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_low_precision_inputs_compute_in_float32_and_return_their_dtype(dtype):
    u, k, D, pre, post = _operands(2, 3, 50, 50, seed=4, dtype=dtype)
    y = reference.fftconv_fft(u, k, D, pre, post, gelu=True)
    assert y.dtype == dtype
    exact = reference.fftconv_direct(*(t.double() for t in (u, k, D, pre, post)), gelu=True)
    err = ((y.double() - exact).norm() / exact.norm()).item()
    assert err < 2 * torch.finfo(dtype).eps  # the output's rounding, no more
    # k and D may keep another float dtype than u's
    y32 = reference.fftconv_fft(u, k.float(), D.double(), pre, post, gelu=True)
    assert y32.dtype == dtype


@pytest.mark.parametrize("gelu", [False, True])
@pytest.mark.parametrize("Lk", [5, 16, 23])
def test_steps_from_an_empty_history_equal_the_full_op(gelu, Lk):
    B, H, L = 2, 3, 16
    u, k, D, pre, post = _operands(B, H, L, Lk, seed=Lk)
    full = reference.fftconv_fft(u, k, D, pre, post, gelu)
    history = torch.full((B, H, L + 3), float("nan"), dtype=F64)  # unwritten positions are never read
    steps = []
    for t in range(L):
        position = t if t % 2 else torch.tensor(t)
        steps.append(reference.fftconv_step(history, u[:, :, t], k, position, D, pre[:, :, t], post[:, :, t], gelu))
    assert torch.allclose(torch.stack(steps, dim=-1), full, atol=1e-12)
    assert torch.allclose(history[:, :, :L], u * pre)  # the pregated inputs, kept in place


def test_causal_a_later_input_never_changes_an_earlier_output():
    L = 40
    u, k, D, pre, post = _operands(2, 3, L, L, seed=5)
    y = reference.fftconv_fft(u, k, D, pre, post, gelu=True)
    for t in (0, 17, L - 2):
        changed = [x.clone() for x in (u, pre, post)]
        for x in changed:
            x[:, :, t + 1:] = torch.randn_like(x[:, :, t + 1:])
        y2 = reference.fftconv_fft(changed[0], k, D, changed[1], changed[2], gelu=True)
        assert torch.equal(y2[:, :, :t + 1], y[:, :, :t + 1]) or torch.allclose(y2[:, :, :t + 1], y[:, :, :t + 1],
                                                                                rtol=0, atol=1e-13)
        assert not torch.allclose(y2[:, :, t + 1:], y[:, :, t + 1:])


def _full_args():
    u, k, D, pre, post = _operands(2, 3, 10, 10, seed=6, dtype=torch.float32)
    return {"u": u, "k": k, "D": D, "pregate": pre, "postgate": post}


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda a: {**a, "u": a["u"][0]}, ValueError, "u must be 3-D"),
        (lambda a: {**a, "u": a["u"].int()}, TypeError, "u must be float16"),
        (lambda a: {**a, "k": a["k"][:2]}, ValueError, "k must be"),
        (lambda a: {**a, "k": a["k"][:, :0]}, ValueError, "k must be"),
        (lambda a: {**a, "k": a["k"][None]}, ValueError, "k must be"),
        (lambda a: {**a, "k": a["k"].long()}, TypeError, "k must be float16"),
        (lambda a: {**a, "D": a["D"][:2]}, ValueError, "D must be"),
        (lambda a: {**a, "D": a["D"].bool()}, TypeError, "D must be float16"),
        (lambda a: {**a, "pregate": a["pregate"][:, :, :9]}, ValueError, "pregate must have u's shape"),
        (lambda a: {**a, "postgate": a["postgate"].double()}, TypeError, "postgate has dtype"),
        (lambda a: {**a, "k": a["k"].to("meta")}, ValueError, "k is on meta"),
        (lambda a: {**a, "postgate": [1.0]}, TypeError, "postgate must be a tensor"),
    ],
)
@pytest.mark.parametrize("fn", [reference.fftconv_fft, reference.fftconv_direct])
def test_bad_operands_are_refused_naming_them(fn, change, error, message):
    with pytest.raises(error, match=message):
        fn(**change(_full_args()))


@pytest.mark.parametrize(
    "change,error,message",
    [
        (lambda a: {**a, "position": 8}, ValueError, "position must be in"),
        (lambda a: {**a, "position": -1}, ValueError, "position must be in"),
        (lambda a: {**a, "position": torch.tensor(8)}, ValueError, "position must be in"),
        (lambda a: {**a, "position": torch.tensor([1])}, TypeError, "position must be an int"),
        (lambda a: {**a, "position": torch.tensor(1, dtype=torch.int32)}, TypeError, "position must be an int"),
        (lambda a: {**a, "position": 1.0}, TypeError, "position must be an int"),
        (lambda a: {**a, "history": a["history"][:, :2]}, ValueError, "history must be"),
        (lambda a: {**a, "history": a["history"].double()}, TypeError, "history has dtype"),
        (lambda a: {**a, "u_t": a["u_t"][0]}, ValueError, "u_t must be 2-D"),
        (lambda a: {**a, "k": a["k"][:1]}, ValueError, "k must be"),
        (lambda a: {**a, "pregate": a["pregate"][:1]}, ValueError, "pregate must be"),
    ],
)
def test_bad_step_operands_are_refused_naming_them(change, error, message):
    g = torch.Generator().manual_seed(7)
    args = {"history": torch.zeros(2, 3, 8), "u_t": torch.randn(2, 3, generator=g),
            "k": torch.randn(3, 5, generator=g), "position": 2, "D": torch.randn(3, generator=g),
            "pregate": torch.randn(2, 3, generator=g), "postgate": torch.randn(2, 3, generator=g)}
    with pytest.raises(error, match=message):
        reference.fftconv_step(**change(args))


# ---- the op surface on the CPU: dispatch, fake ops, the spectrum cache ----

from bem.kernels.fftconv import dispatch as fftconv_ops  # noqa: E402
from bem.kernels.fftconv import custom_ops, dispatch  # noqa: E402


def test_dispatch_on_cpu_runs_the_reference_and_says_why():
    u, k, D, pre, post = _operands(2, 3, 20, 9, seed=8, dtype=torch.float32)
    reason = fftconv_ops.fftconv_unavailable_reason(u, k)
    assert reason is not None and "cpu" in reason
    assert fftconv_ops.fftconv_unavailable_reason(u, k, use_fused=False) == "use_fused is False"
    y = fftconv_ops.fftconv(u, k, D, pre, post, gelu=True)
    assert torch.equal(y, reference.fftconv_fft(u, k, D, pre, post, gelu=True))
    history = torch.zeros(2, 3, 4)
    y_t = fftconv_ops.fftconv_step(history, u[:, :, 0], k, 0, D, pre[:, :, 0], post[:, :, 0], gelu=True)
    assert torch.allclose(y_t, y[:, :, 0], atol=1e-6)
    assert fftconv_ops.step_unavailable_reason(history, u[:, :, 0], k) is not None
    with pytest.raises(ValueError, match="k must be"):
        fftconv_ops.fftconv(u, k[:2], D)


def test_reference_gradients_flow_to_every_operand():
    u, k, D, pre, post = (t.requires_grad_() for t in _operands(1, 2, 9, 6, seed=9))
    fftconv_ops.fftconv(u, k, D, pre, post, gelu=True).square().sum().backward()
    assert all(t.grad is not None and t.grad.abs().sum() > 0 for t in (u, k, D, pre, post))


def test_spectrum_length_pads_short_sequences_and_rounds_up():
    assert [custom_ops.spectrum_length(L) for L in (1, 1000, 1024, 1025, 3000, 16384, 100000)] == [
        1024, 1024, 1024, 2048, 4096, 16384, 131072]


def test_fake_ops_give_the_shapes_the_kernels_return():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        u = torch.empty(2, 3, 3000, dtype=torch.bfloat16)
        k = torch.empty(3, 100)
        D = torch.empty(3)
        S = custom_ops.fftconv_spectrum(k, 3000)
        assert S.shape == (3, 4097) and S.dtype == torch.complex64
        y = custom_ops.fftconv(u, k, D, u, u, True, S)
        assert y.shape == u.shape and y.dtype == u.dtype
        # the op's second output: the spectrum it computed, kept for the backward (up to M = 16384), else empty
        assert custom_ops.fftconv_op(u, k, D, None, None, False, S)[1].shape == (0,)
        assert custom_ops.fftconv_op(u, k, D, None, None, False, None)[1].shape == (3, 4097)
        long_u = torch.empty(1, 3, 20000, dtype=torch.bfloat16)
        assert custom_ops.fftconv_op(long_u, k, D, None, None, False, None)[1].shape == (0,)
        grads = custom_ops.fftconv_bwd(u, u, k, D, None, u, True, None, [True, True, False, False, True])
        assert [tuple(g.shape) for g in grads] == [tuple(u.shape), (3, 100), (0,), (0,), tuple(u.shape)]
        assert grads[1].dtype == k.dtype
        y_t = custom_ops.fftconv_step(torch.empty(2, 3, 50, dtype=torch.bfloat16), u[:, :, 0], k, None, 4, D,
                                      None, None, False)
        assert y_t.shape == (2, 3) and y_t.dtype == torch.bfloat16


def test_spectrum_cache_reuses_while_k_is_unchanged(monkeypatch):
    calls = []
    monkeypatch.setattr(custom_ops, "fftconv_spectrum", lambda k, L: calls.append(L) or torch.randn(1))
    cache = dispatch.SpectrumCache(size=2)
    u, k, D, _, _ = _operands(1, 3, 100, 30, seed=10, dtype=torch.float32, gates=False)
    first = cache.get(k, 100)
    assert cache.get(k, 90) is first and len(calls) == 1  # same spectrum length (1024)
    assert cache.get(k, 2000) is not first and len(calls) == 2  # another length
    k.mul_(2.0)  # changed in place: its version moves on
    cache.get(k, 100)
    assert len(calls) == 3
    same_values = k.clone()  # another tensor, even with the same values
    cache.get(same_values, 100)
    assert len(calls) == 4
    del k, same_values
    import gc

    gc.collect()
    assert len(cache._entries) == 0  # the entries died with their k
    assert not dispatch.SpectrumCache.applies(u, D.clone().requires_grad_()[:, None])
    assert dispatch.SpectrumCache.applies(u, D[:, None])
    with torch.inference_mode():
        assert not dispatch.SpectrumCache.applies(u, torch.ones(3, 4))

