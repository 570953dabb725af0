"""The chunkwise mLSTM backward written out in PyTorch ops: the same quantities, in the same order, as the
CUDA backward kernels compute them (so it documents and checks their maths), and the backward that runs
where those kernels do not.

With n_t = max(|den_t|, exp(-m_t)) and the stabilisers m held fixed (h does not depend on them):

    dnum_t = dh_t / n_t                                    gradient of the stabilised numerator
    beta_t = -(dh_t·h_t) / n_t · sign(den_t) · [|den_t| > exp(-m_t)]   ... and of the denominator
    R_c    = exp(G_c + m_c - m_{c+1}) R_{c+1} + sum_{t in c} exp(g_t + m_c - m_t) q̂_t [dnum_t, beta_t]ᵀ
             (the gradient of the state entering chunk c, from the last chunk back; R_NC = dC of the last state)
    P_ts   = (dnum_t·v_s + beta_t) exp(g_t - g_s + ĩ_s - m_t)        (s <= t in one chunk)
    dq_t   = (P k)_t / √d + exp(g_t + m_c - m_t) / √d · (C_c dnum_t + beta_t n_c)
    dk_s   = (Pᵀ q)_s / √d + w_s (R_{c+1} v_s + Rn_{c+1}),   w_s = exp(G_c - g_s + ĩ_s - m_{c+1})
    dv_s   = sum_t (q̂_t·k_s) exp(g_t - g_s + ĩ_s - m_t) dnum_t + w_s R_{c+1}ᵀ k_s

Every log weight is a pair (query, key) with weight exp(b_t - b_s + ĩ_s) over the global cumulative
log-forget b, so the gates' gradients follow from the rows' and columns' sums: dĩ_s = k_s·dk_s, and
d(log σ(f̃_r)) = sum_{j >= r} (q_j·dq_j - k_j·dk_j), plus <dC, C> + <dn, n> of the last state at the last
token. The initial state's stabiliser gets dm0 = <dC0, C0> + <dn0, n0>. The last state's own m is a
stabiliser: its incoming gradient is not used (exact for any consumer of the true state exp(m) (C, n),
such as the next piece of a prefill).
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from .reference import State, chunk_gates, stabilised_normaliser, to_chunks


def _chunks_of(x: Tensor, L: int, pad_value: float = 0.0) -> Tensor:
    """(B, NH, S) -> (B, NH, NC, L), padded with pad_value."""
    S = x.shape[-1]
    NC = -(-S // L)
    return F.pad(x, (0, NC * L - S), value=pad_value).reshape(*x.shape[:-1], NC, L)


def _from_chunks(x: Tensor, S: int) -> Tensor:
    """(B, NH, NC, L, ...) -> (B, NH, S, ...)."""
    return x.reshape(x.shape[0], x.shape[1], -1, *x.shape[4:])[:, :, :S]


def chunkwise_backward(
    dh: Tensor, q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, h: Tensor, m: Tensor, den: Tensor,
    C_states: Tensor, n_states: Tensor, m_states: Tensor, chunk_size: int,
    last_state: Optional[State] = None,
    d_last: Optional[tuple[Optional[Tensor], Optional[Tensor]]] = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    """(dq, dk, dv, digate, dfgate, dC0, dn0) of the chunkwise forward (`reference.chunkwise`, or the kernels'
    forward, which keeps the same m, den and chunk states). dh (B, NH, S, DHV); h the forward's output;
    d_last: the gradients (dC, dn) of the returned last state, or None. The gates' gradients and (dC0, dn0),
    the gradient of the initial state's C and n, come in the accumulation dtype; dm0 is `initial_state_grad`."""
    B, NH, S, DHQK = q.shape
    acc = m.dtype
    L = min(chunk_size, S)
    scale = 1.0 / math.sqrt(DHQK)
    i, g = chunk_gates(igate, fgate, L, acc)
    NC = i.shape[-2]
    qc, kc, vc = (to_chunks(t.to(acc), L) for t in (q, k, v))
    dhc, hc = to_chunks(dh.to(acc), L), to_chunks(h.to(acc), L)
    valid = _chunks_of(torch.ones(S, device=q.device, dtype=torch.bool), L, False)
    m_tok = _chunks_of(m, L, math.inf)  # padded rows: +inf makes every weight of theirs exp(-inf) = 0
    den_tok = _chunks_of(den, L)
    n_tok = torch.where(valid, stabilised_normaliser(den_tok, m_tok), torch.ones_like(den_tok))
    unclamped = den_tok.abs() > torch.exp(-m_tok)
    beta = torch.where(unclamped, -(dhc * hc).sum(-1) / n_tok * torch.sign(den_tok), torch.zeros_like(den_tok))
    dnum = dhc / n_tok[..., None]
    m_c, m_next = m_states[..., :-1], m_states[..., 1:]
    G = g[..., -1]

    # The gradients of the chunk states, from the last chunk back.
    e = torch.exp(g + m_c[..., None] - m_tok)
    qw = qc * (e * scale)[..., None]
    R_local = qw.transpose(-1, -2) @ dnum
    Rn_local = (qw * beta[..., None]).sum(-2)
    carry = torch.exp(G + m_c - m_next)
    dC_last = d_last[0] if d_last is not None else None
    dn_last = d_last[1] if d_last is not None else None
    R = dC_last.to(acc) if dC_last is not None else torch.zeros_like(C_states[:, :, 0])
    Rn = dn_last.to(acc) if dn_last is not None else torch.zeros_like(n_states[:, :, 0])
    R_after, Rn_after = [None] * NC, [None] * NC
    for c in reversed(range(NC)):
        R_after[c], Rn_after[c] = R, Rn
        R = carry[..., c, None, None] * R + R_local[..., c, :, :]
        Rn = carry[..., c, None] * Rn + Rn_local[..., c, :]
    R_after_all, Rn_after_all = torch.stack(R_after, 2), torch.stack(Rn_after, 2)

    # Within each chunk, and the chunk states' share.
    causal = torch.ones(L, L, dtype=torch.bool, device=q.device).tril()
    log_d = (g[..., :, None] - g[..., None, :] + i[..., None, :]).masked_fill(~causal, -math.inf)
    decay = torch.exp(log_d - m_tok[..., None])
    P = (dnum @ vc.transpose(-1, -2) + beta[..., None]) * decay
    inter_q = (e * scale)[..., None] * (dnum @ C_states.transpose(-1, -2) + beta[..., None] * n_states[..., None, :])
    dq = (P @ kc) * scale + inter_q
    w_key = torch.exp(G[..., None] - g + i - m_next[..., None])
    dk = (P.transpose(-1, -2) @ qc) * scale + w_key[..., None] * (vc @ R_after_all.transpose(-1, -2)
                                                                  + Rn_after_all[..., None, :])
    scores = (qc @ kc.transpose(-1, -2)) * scale
    dv = (scores * decay).transpose(-1, -2) @ dnum + w_key[..., None] * (kc @ R_after_all)

    # The gates, from the rows' and columns' sums.
    last_term = None
    if last_state is not None and d_last is not None:
        last_term = last_state_term(last_state[0], last_state[1], dC_last, dn_last)
    di, df = gate_grads(_from_chunks((qc * dq).sum(-1), S), _from_chunks((kc * dk).sum(-1), S), fgate, last_term)
    return (_from_chunks(dq, S).to(q.dtype), _from_chunks(dk, S).to(k.dtype), _from_chunks(dv, S).to(v.dtype),
            di, df, R, Rn)


def last_state_term(C_last: Tensor, n_last: Tensor, dC_last: Optional[Tensor], dn_last: Optional[Tensor]) -> Tensor:
    """<dC, C> + <dn, n> of the last state (B, NH): every part of it carries the log-forget up to the last token."""
    term = torch.zeros(C_last.shape[:2], dtype=C_last.dtype, device=C_last.device)
    if dC_last is not None:
        term = term + (dC_last.to(C_last.dtype) * C_last).sum((-1, -2))
    if dn_last is not None:
        term = term + (dn_last.to(n_last.dtype) * n_last).sum(-1)
    return term


def gate_grads(qdq: Tensor, kdk: Tensor, fgate: Tensor, last_term: Optional[Tensor]) -> tuple[Tensor, Tensor]:
    """(dĩ, df̃) in the accumulation dtype from q_t·dq_t and k_t·dk_t (B, NH, S) and the last state's term."""
    db = qdq - kdk
    if last_term is not None:
        db = torch.cat([db[..., :-1], (db[..., -1] + last_term)[..., None]], -1)
    dlf = db.flip(-1).cumsum(-1).flip(-1)
    return kdk, dlf * torch.sigmoid(-fgate.to(qdq.dtype))


def initial_state_grad(dC0: Tensor, dn0: Tensor, C0: Tensor, n0: Tensor) -> Tensor:
    """dm0 = <dC0, C0> + <dn0, n0>: the initial state holds the memory exp(m0) (C0, n0)."""
    return (dC0 * C0.to(dC0.dtype)).sum((-1, -2)) + (dn0 * n0.to(dn0.dtype)).sum(-1)
