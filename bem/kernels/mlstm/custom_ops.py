"""The mLSTM kernels as `torch.library` custom ops, with fake (meta) implementations for `torch.compile` and
an autograd formula. Registered whether or not the extension loaded: on tensors the kernels do not take
(CPU, float64, no extension) each op runs the same contract in PyTorch (`reference.chunkwise`,
`backward.chunkwise_backward`), so the op surface is one and testable anywhere.

    bem::mlstm_chunkwise_fwd(q, k, v, igate, fgate, C0, n0, m0)
        -> (h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states)
    bem::mlstm_chunkwise_bwd(dh, q, k, v, igate, fgate, h, m_tok, den_tok, C_states, n_states, m_states,
                             C_last, n_last, dC_last, dn_last) -> (dq, dk, dv, digate, dfgate, dC0, dn0)
    bem::mlstm_step(q, k, v, igate, fgate, C, n, m) -> (h, C', n', m')

Chunks of CHUNK tokens; m_tok, den_tok (B, NH, S): each token's stabiliser and signed stabilised denominator;
C_states (B, NH, NC, DHQK, DHV) (bfloat16 for bfloat16 inputs, else float32), n_states (B, NH, NC, DHQK):
the state entering each chunk; m_states (B, NH, NC + 1). Everything but h and the gradients of q, k, v is
float32 (float64 for float64 inputs).

The extension is bem._C (`bem.kernels.custom_ops.extension()`); with BEM_MLSTM_DEV_MODULE=1 it is instead a
module of the mLSTM sources alone, built on first use (scripts/mlstm_dev_module.cpp, scripts/gpu/mlstm.sh).
"""

from __future__ import annotations

import os
from pathlib import Path
from types import ModuleType
from typing import Optional

import torch
from torch import Tensor
import torch.nn.functional as F

from . import backward, reference, selfcheck

CHUNK = 64  # tokens per chunk of the kernels (kMlstmChunk in mlstm_launchers.h)
KERNEL_DTYPES = (torch.float16, torch.bfloat16, torch.float32)

_NOT_LOOKED = object()
_found: object = _NOT_LOOKED


def _build_dev_module() -> ModuleType:
    from torch.utils.cpp_extension import load

    from .. import loader

    root = Path(__file__).resolve().parents[3]
    sources = [str(loader.CSRC / name) for name in loader.family_sources("mlstm")]
    return load(name="bem_mlstm_dev", sources=sources + [str(root / "scripts" / "mlstm_dev_module.cpp")],
                extra_cflags=["-O3", "-std=c++17"], extra_cuda_cflags=["-O3", "-std=c++17", "--use_fast_math",
                                                                       "-lineinfo"],
                verbose=os.environ.get("BEM_JIT_VERBOSE") == "1")


def extension() -> Optional[ModuleType]:
    """The module with the mLSTM kernels, or None (looked up once, on first use)."""
    global _found
    if _found is _NOT_LOOKED:
        if os.environ.get("BEM_MLSTM_DEV_MODULE") == "1" and torch.cuda.is_available():
            _found = _build_dev_module()
        else:
            from .. import custom_ops as base

            module = base.extension()
            _found = module if module is not None and hasattr(module, "mlstm_forward") else None
    return _found  # type: ignore[return-value]


def acc_dtype(q: Tensor) -> torch.dtype:
    return torch.float64 if q.dtype == torch.float64 else torch.float32


def states_dtype(q: Tensor) -> torch.dtype:
    return torch.bfloat16 if q.dtype == torch.bfloat16 else acc_dtype(q)


def kernel_failure(device: torch.device) -> Optional[str]:
    """Why the kernels failed their first-use check on this device (`selfcheck`), or None."""
    return selfcheck.kernel_failure(extension(), device)


def _kernel_takes(q: Tensor) -> bool:
    return q.is_cuda and q.dtype in KERNEL_DTYPES and extension() is not None and kernel_failure(q.device) is None


@torch.library.custom_op("bem::mlstm_chunkwise_fwd", mutates_args=())
def mlstm_chunkwise_fwd(
    q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, C0: Optional[Tensor], n0: Optional[Tensor],
    m0: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    if _kernel_takes(q):
        return tuple(extension().mlstm_forward(q, k, v, igate, fgate, C0, n0, m0))
    state = None if C0 is None else (C0, n0, m0)
    out = reference.chunkwise(q, k, v, igate, fgate, state, CHUNK)
    C, n, m = out.last
    return (out.h.to(q.dtype).contiguous(), C, n, m, out.m.contiguous(), out.den.contiguous(),
            out.C_states.to(states_dtype(q)), out.n_states, out.m_states)


@mlstm_chunkwise_fwd.register_fake
def _(q, k, v, igate, fgate, C0, n0, m0):
    B, NH, S, DK = q.shape
    DV = v.shape[-1]
    NC = -(-S // CHUNK)
    acc = acc_dtype(q)
    return (v.new_empty(B, NH, S, DV, dtype=q.dtype), q.new_empty(B, NH, DK, DV, dtype=acc),
            q.new_empty(B, NH, DK, dtype=acc), q.new_empty(B, NH, dtype=acc), q.new_empty(B, NH, S, dtype=acc),
            q.new_empty(B, NH, S, dtype=acc), q.new_empty(B, NH, NC, DK, DV, dtype=states_dtype(q)),
            q.new_empty(B, NH, NC, DK, dtype=acc), q.new_empty(B, NH, NC + 1, dtype=acc))


@torch.library.custom_op("bem::mlstm_chunkwise_bwd", mutates_args=())
def mlstm_chunkwise_bwd(
    dh: Tensor, q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, h: Tensor, m_tok: Tensor,
    den_tok: Tensor, C_states: Tensor, n_states: Tensor, m_states: Tensor, C_last: Tensor, n_last: Tensor,
    dC_last: Optional[Tensor], dn_last: Optional[Tensor],
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor, Tensor, Tensor]:
    dh = dh.to(q.dtype).contiguous()
    kernel = _kernel_takes(q)
    last_term = None
    if dC_last is not None or dn_last is not None:
        # the kernel multiplies dC_last on the tensor cores in the inputs' dtype: the gate gradients pair its
        # k·dk with this term, and the two cancel only if both read the same rounded dC_last
        dC_read = dC_last.to(q.dtype) if kernel and dC_last is not None else dC_last
        last_term = backward.last_state_term(C_last, n_last, dC_read, dn_last)
    if kernel:
        beta = extension().mlstm_beta(dh, h.contiguous(), m_tok, den_tok)
        dC = None if dC_last is None else dC_last.float().contiguous()
        dn = None if dn_last is None else dn_last.float().contiguous()
        dq, dk, dv, qdq, kdk, dC0, dn0 = extension().mlstm_backward(
            dh, q, k, v, igate, fgate, m_tok, den_tok, beta, C_states, n_states, m_states, dC, dn)
        di, df = backward.gate_grads(qdq.sum(0), kdk.sum(0), fgate, last_term)
        return dq, dk, dv, di, df, dC0, dn0
    d_last = None if last_term is None else (dC_last, dn_last)
    grads = backward.chunkwise_backward(dh, q, k, v, igate, fgate, h, m_tok, den_tok, C_states.to(m_tok.dtype),
                                       n_states, m_states, CHUNK, (C_last, n_last, None), d_last)
    return tuple(g.contiguous() for g in grads)


@mlstm_chunkwise_bwd.register_fake
def _(dh, q, k, v, igate, fgate, h, m_tok, den_tok, C_states, n_states, m_states, C_last, n_last, dC_last, dn_last):
    acc = acc_dtype(q)
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), m_tok.new_empty(m_tok.shape, dtype=acc),
            m_tok.new_empty(m_tok.shape, dtype=acc), C_last.new_empty(C_last.shape, dtype=acc),
            n_last.new_empty(n_last.shape, dtype=acc))


def _last_stabiliser_grad(residual: Tensor, igate: Tensor, fgate: Tensor, m0: Optional[Tensor]):
    """Where the last state's m came from: m_last = max(b_{S-1} + m0, max_s (b_{S-1} - b_s + ĩ_s)) over the
    cumulative log-forget b; the gradient `residual` of m_last beyond what (C, n) already account for goes to
    the winning term's gates (zero for any consumer of the true state exp(m) (C, n))."""
    acc = residual.dtype
    b = F.logsigmoid(fgate.to(acc)).cumsum(-1)
    best, s_star = (igate.to(acc) - b).max(-1)
    init = m0.to(acc) if m0 is not None else torch.zeros_like(best)
    init_wins = init >= best
    positions = torch.arange(igate.shape[-1], device=igate.device)
    after = torch.where(init_wins[..., None], True, positions > s_star[..., None])
    dlf = residual[..., None] * after.to(acc)
    di = residual[..., None] * torch.where(init_wins[..., None], False, positions == s_star[..., None]).to(acc)
    return di, dlf * torch.sigmoid(-fgate.to(acc)), residual * init_wins.to(acc)


def _setup_forward(ctx, inputs, output) -> None:
    ctx.set_materialize_grads(False)
    q, k, v, igate, fgate, C0, n0, m0 = inputs
    h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states = output
    ctx.save_for_backward(q, k, v, igate, fgate, C0, n0, m0, h, C_last, n_last, m_tok, den_tok, C_states, n_states,
                          m_states)


def _backward_forward(ctx, dh, dC_last, dn_last, dm_last, *_ignored):
    q, k, v, igate, fgate, C0, n0, m0, h, C_last, n_last, m_tok, den_tok, C_states, n_states, m_states = \
        ctx.saved_tensors
    if dh is None and dC_last is None and dn_last is None and dm_last is None:
        return None, None, None, None, None, None, None, None
    if dh is None:
        dh = torch.zeros_like(h)
    dq, dk, dv, di, df, dC0, dn0 = mlstm_chunkwise_bwd(dh, q, k, v, igate, fgate, h, m_tok, den_tok, C_states,
                                                       n_states, m_states, C_last, n_last, dC_last, dn_last)
    dm0 = backward.initial_state_grad(dC0, dn0, C0, n0) if C0 is not None else None
    if dm_last is not None:
        residual = dm_last.to(di.dtype) - backward.last_state_term(C_last, n_last, dC_last, dn_last)
        di_m, df_m, dm0_m = _last_stabiliser_grad(residual, igate, fgate, m0)
        di, df = di + di_m, df + df_m
        dm0 = None if dm0 is None else dm0 + dm0_m
    if C0 is None:
        dC0 = dn0 = None
    return (dq, dk, dv, di.to(igate.dtype), df.to(fgate.dtype), None if dC0 is None else dC0.to(C0.dtype),
            None if dn0 is None else dn0.to(n0.dtype), None if dm0 is None else dm0.to(m0.dtype))


mlstm_chunkwise_fwd.register_autograd(_backward_forward, setup_context=_setup_forward)


@torch.library.custom_op("bem::mlstm_step", mutates_args=())
def mlstm_step(
    q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, C: Tensor, n: Tensor, m: Tensor
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    if _kernel_takes(q):
        return tuple(extension().mlstm_step(q, k, v, igate, fgate, C, n, m))
    h, (C, n, m) = reference.mlstm_step(q, k, v, igate, fgate, (C, n, m))
    return h, C, n, m


@mlstm_step.register_fake
def _(q, k, v, igate, fgate, C, n, m):
    return (v.new_empty(v.shape, dtype=q.dtype), torch.empty_like(C), torch.empty_like(n), torch.empty_like(m))
