"""A first-use check of the mLSTM kernels: once per device and process, before the kernels first compute
anything, a small forward (with an initial state), backward and step in bfloat16 and float32 against the
float64 reference. Where it fails the ops run the reference and `mlstm_unavailable_reason` says why.

It guards against a build whose kernels compute the wrong thing (another GPU generation, compiler, or
a change not yet run through tests/gpu/test_mlstm.py): with wrong kernels a model would train on wrong
numbers without a sound. Its tolerances catch such errors (they are of order one), not the last bit of
precision, which the GPU tests bound. Cost: a few milliseconds once. BEM_MLSTM_SELFCHECK=0 skips it.
"""

from __future__ import annotations

import math
import os
from typing import Optional

import torch

from . import reference
from .backward import chunkwise_backward

_results: dict[int, Optional[str]] = {}
TOLERANCE = {torch.bfloat16: 0.1, torch.float32: 1e-3}


def kernel_failure(ext, device: torch.device) -> Optional[str]:
    """None when the kernels passed their check on this device (run on the first call), else what failed.
    While a CUDA graph is being captured nothing is run: the check waits for an eager call."""
    if os.environ.get("BEM_MLSTM_SELFCHECK") == "0":
        return None
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _results:
        if torch.cuda.is_current_stream_capturing():
            return None
        with torch.cuda.device(index):
            _results[index] = _check(ext, torch.device("cuda", index))
    return _results[index]


def _err(got: torch.Tensor, want: torch.Tensor) -> float:
    got = got.double()
    if not torch.isfinite(got).all():
        return math.inf
    return ((got - want).norm() / want.norm().clamp_min(1e-30)).item()


def _check(ext, device: torch.device) -> Optional[str]:
    try:
        with torch.no_grad():
            for dtype in (torch.bfloat16, torch.float32):
                failure = _check_dtype(ext, device, dtype)
                if failure is not None:
                    return f"{dtype}: {failure}"
    except Exception as error:  # a launch or a check that fails is as disqualifying as a wrong number
        return f"{type(error).__name__}: {error}"
    return None


def _check_dtype(ext, device: torch.device, dtype: torch.dtype) -> Optional[str]:
    B, NH, S, DK, DV = 1, 2, 100, 48, 40  # two chunks, the second partial; partial column tiles
    g = torch.Generator(device=device).manual_seed(1234)

    def draw(*shape, scale=1.0):
        return (torch.randn(*shape, device=device, generator=g) * scale).to(dtype)

    q, k, v = draw(B, NH, S, DK), draw(B, NH, S, DK), draw(B, NH, S, DV)
    i, f = draw(B, NH, S, scale=3.0), draw(B, NH, S, scale=3.0) + 2.0
    C0 = torch.randn(B, NH, DK, DV, device=device, generator=g) * 0.3
    n0 = torch.randn(B, NH, DK, device=device, generator=g) * 0.3
    m0 = torch.randn(B, NH, device=device, generator=g)
    tol = TOLERANCE[dtype]
    h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states = ext.mlstm_forward(
        q, k, v, i, f, C0, n0, m0)
    as64 = [t.double() for t in (q, k, v, i, f)]
    ref = reference.chunkwise(*as64, (C0.double(), n0.double(), m0.double()), 64)
    for name, got, want in (("h", h, ref.h), ("C", C_last, ref.last[0]), ("n", n_last, ref.last[1]),
                            ("m", m_last, ref.last[2])):
        if _err(got, want) > tol:
            return f"forward {name}: relative error {_err(got, want):.2e} against the float64 reference"

    dh = draw(B, NH, S, DV)
    dC = torch.randn(B, NH, DK, DV, device=device, generator=g)
    dn = torch.randn(B, NH, DK, device=device, generator=g)
    beta = ext.mlstm_beta(dh, h, m_tok, den_tok)
    dq, dk, dv, qdq, kdk, dC0, dn0 = ext.mlstm_backward(dh, q, k, v, i, f, m_tok, den_tok, beta, C_states,
                                                        n_states, m_states, dC, dn)
    want = chunkwise_backward(dh.double(), *as64, ref.h, ref.m, ref.den, ref.C_states, ref.n_states, ref.m_states, 64,
                              ref.last, (dC.double(), dn.double()))
    for name, got, exp in (("dq", dq, want[0]), ("dk", dk, want[1]), ("dv", dv, want[2]),
                           ("k·dk", kdk.sum(0), want[3]), ("dC0", dC0, want[5]), ("dn0", dn0, want[6])):
        if _err(got, exp) > tol:
            return f"backward {name}: relative error {_err(got, exp):.2e} against the float64 reference"

    state = (C0, n0, m0)
    h1, C1, n1, m1 = ext.mlstm_step(q[:, :, 0].contiguous(), k[:, :, 0].contiguous(), v[:, :, 0].contiguous(),
                                    i[:, :, 0].contiguous(), f[:, :, 0].contiguous(), *state)
    h1_ref, (C1_ref, _, m1_ref) = reference.mlstm_step(*(t[:, :, 0] for t in as64),
                                                        tuple(t.double() for t in state))
    for name, got, exp in (("h", h1, h1_ref), ("C", C1, C1_ref), ("m", m1, m1_ref)):
        if _err(got, exp) > tol:
            return f"step {name}: relative error {_err(got, exp):.2e} against the float64 reference"
    return None
