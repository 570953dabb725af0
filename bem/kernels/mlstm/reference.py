"""PyTorch reference of the mLSTM (xLSTM matrix memory, the "vLSTM" stabilised form): the CPU path, the
fallback where the CUDA kernels do not run, and the oracle the kernel tests compare against.

Per batch row and head, with q̂ = q / sqrt(DHQK), log-forget lf = log σ(f̃) and, for a block of tokens that
starts from the state (C0, n0, m0), the inclusive cumulative log-forget g_t = sum_{r <= t} lf_r:

    logD_ts = g_t - g_s + ĩ_s  (s <= t, else -inf)       the log weight of key s at query t
    m_t     = max(g_t + m0, max_s logD_ts)                 the stabiliser (the state counts as one more key)
    num_t   = sum_s exp(logD_ts - m_t) (q̂_t·k_s) v_s + exp(g_t + m0 - m_t) C0ᵀ q̂_t
    den_t   = sum_s exp(logD_ts - m_t) (q̂_t·k_s)     + exp(g_t + m0 - m_t) n0·q̂_t
    h_t     = num_t / max(|den_t|, exp(-m_t))

The state (C, n, m) holds the true memory as exp(m) (C, n), so every value above is a ratio in which m
cancels: in real arithmetic h does not depend on the stabiliser, only the range of the numbers does. A
fresh sequence starts from C = 0, n = 0, m = 0 (`zero_state`), which is what `initial_state=None` means in
every form; the recurrent step then gives the same m_t, h_t and state as the parallel form.

Three formulations, tested against each other (tests/test_mlstm_reference.py):
- `mlstm_parallel`: all S x S log weights at once (short S, tests);
- `mlstm_chunkwise`: chunks of `chunk_size` tokens, the state carried from chunk to chunk, the parallel
  form inside each chunk (O(S) memory; the last chunk may be partial);
- `mlstm_step`: one token per row from a state (decoding).

Arithmetic: gates, stabilisers and states in float32 (float64 for float64 inputs); the products of q, k
and v with each other in the inputs' dtype, as a PyTorch user would write them; h in q's dtype.
"""

from __future__ import annotations

import math
from typing import NamedTuple, Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from . import checks

State = tuple[Tensor, Tensor, Tensor]


def zero_state(B: int, NH: int, DHQK: int, DHV: int, device=None, dtype: torch.dtype = torch.float32) -> State:
    """The state of a fresh sequence: C = 0 (B, NH, DHQK, DHV), n = 0 (B, NH, DHQK), m = 0 (B, NH)."""
    return (torch.zeros(B, NH, DHQK, DHV, device=device, dtype=dtype),
            torch.zeros(B, NH, DHQK, device=device, dtype=dtype),
            torch.zeros(B, NH, device=device, dtype=dtype))


def _state_or_zero(initial_state, q: Tensor, DHV: int, acc: torch.dtype) -> State:
    B, NH, DHQK = q.shape[0], q.shape[1], q.shape[-1]
    if initial_state is None:
        return zero_state(B, NH, DHQK, DHV, q.device, acc)
    C, n, m = initial_state
    return C.to(acc), n.to(acc), m.to(acc)


def stabilised_normaliser(den: Tensor, m: Tensor) -> Tensor:
    """max(|den|, exp(-m)): the denominator of h in the stabilised scale (exp(-m) is 1 in the true scale)."""
    return torch.maximum(den.abs(), torch.exp(-m))


def attend(q: Tensor, k: Tensor, v: Tensor, i: Tensor, g: Tensor, C0: Tensor, n0: Tensor, m0: Tensor):
    """The parallel form over a block of L tokens that starts from the state (C0, n0, m0).

    q, k (..., L, DHQK), v (..., L, DHV) in the inputs' dtype; i (..., L) input gates (-inf marks padding);
    g (..., L) inclusive cumulative log-forget within the block; C0 (..., DHQK, DHV), n0 (..., DHQK),
    m0 (...) in the accumulation dtype. Returns (h, m, den): h (..., L, DHV) in the accumulation dtype, the
    stabiliser m (..., L) and the signed stabilised denominator den (..., L)."""
    acc = g.dtype
    L, DHQK = q.shape[-2], q.shape[-1]
    scale = 1.0 / math.sqrt(DHQK)
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    log_d = (g[..., :, None] - g[..., None, :] + i[..., None, :]).masked_fill(~causal, -math.inf)
    log_state = g + m0[..., None]
    m = torch.maximum(log_state, log_d.amax(-1))
    decay = torch.exp(log_d - m[..., None])
    weights = (q @ k.transpose(-1, -2)).to(acc) * scale * decay
    num = (weights.to(q.dtype) @ v).to(acc)
    den = weights.sum(-1)
    state_weight = torch.exp(log_state - m)
    q_hat = q.to(acc) * scale
    num = num + state_weight[..., None] * (q_hat @ C0)
    den = den + state_weight * (q_hat @ n0[..., None]).squeeze(-1)
    h = num / stabilised_normaliser(den, m)[..., None]
    return h, m, den


def _block_state(k: Tensor, v: Tensor, i: Tensor, g: Tensor, C0: Tensor, n0: Tensor, m0: Tensor) -> State:
    """The state after a block of tokens (same operands as `attend`): the block's last query row."""
    acc = g.dtype
    G = g[..., -1]
    log_w = G[..., None] - g + i
    m = torch.maximum(G + m0, log_w.amax(-1))
    w = torch.exp(log_w - m[..., None])
    kw = k.to(acc) * w[..., None]
    state_weight = torch.exp(G + m0 - m)
    C = state_weight[..., None, None] * C0 + kw.transpose(-1, -2) @ v.to(acc)
    n = state_weight[..., None] * n0 + kw.sum(-2)
    return C, n, m


def mlstm_parallel(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor,
                   initial_state: Optional[State] = None, return_last_state: bool = False):
    """h = mLSTM(q, k, v, ĩ, f̃) from all S x S log weights at once (O(S²) memory: tests and short S).

    q, k (B, NH, S, DHQK); v (B, NH, S, DHV); igate, fgate (B, NH, S); initial_state (C, n, m) or None.
    Returns h (B, NH, S, DHV) in q's dtype, and with return_last_state also the state after the last token."""
    _, _, _, _, DHV = checks.check_sequence(q, k, v, igate, fgate, initial_state)
    acc = checks.acc_dtype(q)
    C0, n0, m0 = _state_or_zero(initial_state, q, DHV, acc)
    g = F.logsigmoid(fgate.to(acc)).cumsum(-1)
    i = igate.to(acc)
    h, _, _ = attend(q, k, v, i, g, C0, n0, m0)
    h = h.to(q.dtype)
    if not return_last_state:
        return h
    return h, _block_state(k, v, i, g, C0, n0, m0)


class Chunkwise(NamedTuple):
    """Everything the chunkwise form computes (the kernels keep the same quantities for their backward).

    h (B, NH, S, DHV) in the accumulation dtype; m, den (B, NH, S) per token; C_states (B, NH, NC, DHQK, DHV),
    n_states (B, NH, NC, DHQK): the state entering each chunk; m_states (B, NH, NC + 1): its stabiliser,
    the last entry that of the final state; last: the state after the last token."""
    h: Tensor
    m: Tensor
    den: Tensor
    C_states: Tensor
    n_states: Tensor
    m_states: Tensor
    last: State


def chunk_gates(igate: Tensor, fgate: Tensor, chunk_size: int, acc: torch.dtype) -> tuple[Tensor, Tensor]:
    """(i, g) per chunk, (B, NH, NC, L): input gates (-inf on the padding after the last token) and the
    inclusive cumulative log-forget within each chunk (log-forget 0 on the padding)."""
    S = igate.shape[-1]
    NC = -(-S // chunk_size)
    pad = NC * chunk_size - S
    lf = F.pad(F.logsigmoid(fgate.to(acc)), (0, pad), value=0.0)
    i = F.pad(igate.to(acc), (0, pad), value=-math.inf)
    shape = (*igate.shape[:-1], NC, chunk_size)
    return i.reshape(shape), lf.reshape(shape).cumsum(-1)


def to_chunks(x: Tensor, chunk_size: int) -> Tensor:
    """(B, NH, S, D) -> (B, NH, NC, L, D), zero-padded after the last token."""
    S = x.shape[-2]
    NC = -(-S // chunk_size)
    x = F.pad(x, (0, 0, 0, NC * chunk_size - S))
    return x.reshape(*x.shape[:-2], NC, chunk_size, x.shape[-1])


def chunkwise(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, initial_state: Optional[State] = None,
              chunk_size: int = 64) -> Chunkwise:
    """The chunkwise form with all its intermediate quantities (see `Chunkwise`); checked operands."""
    B, NH, S, DHQK, DHV = checks.check_sequence(q, k, v, igate, fgate, initial_state)
    checks.check_chunk_size(chunk_size)
    acc = checks.acc_dtype(q)
    L = min(chunk_size, S)
    C, n, m = _state_or_zero(initial_state, q, DHV, acc)
    i, g = chunk_gates(igate, fgate, L, acc)
    qc, kc, vc = to_chunks(q, L), to_chunks(k, L), to_chunks(v, L)
    NC = i.shape[-2]
    # Each chunk's own contribution to the state at its end, all chunks at once ...
    G = g[..., -1]
    log_w = G[..., None] - g + i
    m_local = log_w.amax(-1)
    kw = kc.to(acc) * torch.exp(log_w - m_local[..., None])[..., None]
    C_local = kw.transpose(-1, -2) @ vc.to(acc)
    n_local = kw.sum(-2)
    # ... then the states from chunk to chunk, each rescaled to the larger stabiliser.
    C_states, n_states, m_states = [], [], [m]
    for c in range(NC):
        C_states.append(C)
        n_states.append(n)
        m_next = torch.maximum(G[..., c] + m, m_local[..., c])
        carry, local = torch.exp(G[..., c] + m - m_next), torch.exp(m_local[..., c] - m_next)
        C = carry[..., None, None] * C + local[..., None, None] * C_local[..., c, :, :]
        n = carry[..., None] * n + local[..., None] * n_local[..., c, :]
        m = m_next
        m_states.append(m)
    C_all, n_all, m_all = torch.stack(C_states, 2), torch.stack(n_states, 2), torch.stack(m_states, 2)
    h, m_tok, den = attend(qc, kc, vc, i, g, C_all, n_all, m_all[..., :-1])
    return Chunkwise(h.reshape(B, NH, NC * L, DHV)[:, :, :S], m_tok.reshape(B, NH, -1)[..., :S],
                     den.reshape(B, NH, -1)[..., :S], C_all, n_all, m_all, (C, n, m))


def mlstm_chunkwise(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor,
                    initial_state: Optional[State] = None, return_last_state: bool = False, chunk_size: int = 64):
    """h = mLSTM(q, k, v, ĩ, f̃) chunk by chunk: O(S) memory, any S (the last chunk may be partial).

    Same arguments and results as `mlstm_parallel`, plus chunk_size (tokens per chunk)."""
    out = chunkwise(q, k, v, igate, fgate, initial_state, chunk_size)
    h = out.h.to(q.dtype)
    return (h, out.last) if return_last_state else h


def mlstm_step(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: State) -> tuple[Tensor, State]:
    """One token per row from the state (C, n, m): the recurrent form.

    q, k (B, NH, DHQK); v (B, NH, DHV); igate, fgate (B, NH); state (C (B, NH, DHQK, DHV), n (B, NH, DHQK),
    m (B, NH)). Returns (h (B, NH, DHV) in q's dtype, the next state in float32 (float64 for float64))."""
    checks.check_step(q, k, v, igate, fgate, state)
    acc = checks.acc_dtype(q)
    C, n, m = (t.to(acc) for t in state)
    lf = F.logsigmoid(fgate.to(acc))
    i = igate.to(acc)
    m_next = torch.maximum(lf + m, i)
    carry = torch.exp(lf + m - m_next)  # exp(m_prev - m) ordering: <= 1, finite for any finite gates
    write = torch.exp(i - m_next)
    k_acc, v_acc = k.to(acc), v.to(acc)
    C = carry[..., None, None] * C + write[..., None, None] * (k_acc[..., :, None] * v_acc[..., None, :])
    n = carry[..., None] * n + write[..., None] * k_acc
    q_hat = q.to(acc) / math.sqrt(q.shape[-1])
    num = (q_hat[..., None, :] @ C).squeeze(-2)
    den = (q_hat * n).sum(-1)
    h = num / stabilised_normaliser(den, m_next)[..., None]
    return h.to(q.dtype), (C, n, m_next)
