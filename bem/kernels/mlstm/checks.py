"""Argument checks shared by the mLSTM reference and dispatch: each bad input raises a ValueError or
TypeError naming the operand, before anything is computed or launched.

Shapes (B batch rows, NH heads, S tokens, DHQK / DHV head dims):
    q, k (B, NH, S, DHQK); v (B, NH, S, DHV); igate, fgate (B, NH, S)
    state = (C (B, NH, DHQK, DHV), n (B, NH, DHQK), m (B, NH))
The step takes one token per row: q, k (B, NH, DHQK); v (B, NH, DHV); igate, fgate (B, NH).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _tensor(t, name: str) -> torch.Tensor:
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    if t.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be float16, bfloat16, float32 or float64, got {t.dtype}")
    return t


def _same_device(t: torch.Tensor, name: str, q: torch.Tensor) -> None:
    if t.device != q.device:
        raise ValueError(f"{name} is on {t.device} but q is on {q.device}")


def _shape(t: torch.Tensor, name: str, expected: Sequence[int], what: str) -> None:
    if tuple(t.shape) != tuple(expected):
        raise ValueError(f"{name} must be {what} = {tuple(expected)}, got {tuple(t.shape)}")


def check_state(state, B: int, NH: int, DHQK: int, DHV: int, q: torch.Tensor, name: str = "initial_state") -> None:
    if not isinstance(state, (tuple, list)) or len(state) != 3:
        raise TypeError(f"{name} must be a tuple (C, n, m), got {type(state).__name__}")
    C, n, m = state
    _shape(_tensor(C, f"{name} C"), f"{name} C", (B, NH, DHQK, DHV), "(B, NH, DHQK, DHV)")
    _shape(_tensor(n, f"{name} n"), f"{name} n", (B, NH, DHQK), "(B, NH, DHQK)")
    _shape(_tensor(m, f"{name} m"), f"{name} m", (B, NH), "(B, NH)")
    for t, part in ((C, "C"), (n, "n"), (m, "m")):
        _same_device(t, f"{name} {part}", q)


def check_sequence(q, k, v, igate, fgate, initial_state=None) -> tuple[int, int, int, int, int]:
    """Checks the operands of the parallel / chunkwise forms; returns (B, NH, S, DHQK, DHV)."""
    q = _tensor(q, "q")
    if q.dim() != 4:
        raise ValueError(f"q must be 4-D (B, NH, S, DHQK), got shape {tuple(q.shape)}")
    B, NH, S, DHQK = q.shape
    if S == 0 or DHQK == 0 or B == 0 or NH == 0:
        raise ValueError(f"q must have non-empty dimensions (B, NH, S, DHQK), got {tuple(q.shape)}")
    _shape(_tensor(k, "k"), "k", (B, NH, S, DHQK), "(B, NH, S, DHQK) like q")
    v = _tensor(v, "v")
    if v.dim() != 4 or tuple(v.shape[:3]) != (B, NH, S) or v.shape[3] == 0:
        raise ValueError(f"v must be (B, NH, S, DHV) = ({B}, {NH}, {S}, DHV), got {tuple(v.shape)}")
    DHV = v.shape[3]
    _shape(_tensor(igate, "igate"), "igate", (B, NH, S), "(B, NH, S)")
    _shape(_tensor(fgate, "fgate"), "fgate", (B, NH, S), "(B, NH, S)")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v share one dtype")
    for t, name in ((k, "k"), (v, "v"), (igate, "igate"), (fgate, "fgate")):
        _same_device(t, name, q)
    if initial_state is not None:
        check_state(initial_state, B, NH, DHQK, DHV, q)
    return B, NH, S, DHQK, DHV


def check_step(q, k, v, igate, fgate, state) -> tuple[int, int, int, int]:
    """Checks the operands of the recurrent step; returns (B, NH, DHQK, DHV)."""
    q = _tensor(q, "q")
    if q.dim() != 3:
        raise ValueError(f"q must be 3-D (B, NH, DHQK) for one token per row, got shape {tuple(q.shape)}")
    B, NH, DHQK = q.shape
    if B == 0 or NH == 0 or DHQK == 0:
        raise ValueError(f"q must have non-empty dimensions (B, NH, DHQK), got {tuple(q.shape)}")
    _shape(_tensor(k, "k"), "k", (B, NH, DHQK), "(B, NH, DHQK) like q")
    v = _tensor(v, "v")
    if v.dim() != 3 or tuple(v.shape[:2]) != (B, NH) or v.shape[2] == 0:
        raise ValueError(f"v must be (B, NH, DHV) = ({B}, {NH}, DHV), got {tuple(v.shape)}")
    DHV = v.shape[2]
    _shape(_tensor(igate, "igate"), "igate", (B, NH), "(B, NH)")
    _shape(_tensor(fgate, "fgate"), "fgate", (B, NH), "(B, NH)")
    for t, name in ((k, "k"), (v, "v")):
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}; q, k and v share one dtype")
    for t, name in ((k, "k"), (v, "v"), (igate, "igate"), (fgate, "fgate")):
        _same_device(t, name, q)
    if state is None:
        raise ValueError("state must be (C, n, m); start a sequence from mlstm.zero_state(...)")
    check_state(state, B, NH, DHQK, DHV, q, name="state")
    return B, NH, DHQK, DHV


def check_chunk_size(chunk_size: int) -> None:
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")


def acc_dtype(t: torch.Tensor) -> torch.dtype:
    """Dtype of the state and of all gate and accumulation arithmetic: float64 for float64 inputs, else float32."""
    return torch.float64 if t.dtype == torch.float64 else torch.float32


def optional_state(state) -> Optional[tuple]:
    return None if state is None else tuple(state)
