"""The single dispatch point of the mLSTM ops: the CUDA kernels where they take the call, else the PyTorch
chunkwise reference. `mlstm_unavailable_reason` says why the reference runs.

    h = mlstm(q, k, v, igate, fgate)                                    # (B, NH, S, DHV)
    h, state = mlstm(q, k, v, igate, fgate, initial_state=state, return_last_state=True)
    h, state = mlstm_step(q1, k1, v1, igate1, fgate1, state)           # one token per row

q, k (B, NH, S, DHQK); v (B, NH, S, DHV); igate, fgate (B, NH, S) gate pre-activations; state = (C (B, NH,
DHQK, DHV), n (B, NH, DHQK), m (B, NH)) in float32. The kernels take float16, bfloat16 and float32 inputs
(fp32 state and accumulation), any S and any head dims; gradients flow to q, k, v, both gates and the
initial state. The step has no autograd: with gradients wanted it runs the reference.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from . import checks, custom_ops, reference

State = reference.State


def mlstm_unavailable_reason(q: Tensor, use_fused: bool = True) -> Optional[str]:
    """None when the kernels take a call with this q, else why the reference runs instead."""
    if not use_fused:
        return "use_fused is False"
    if q.device.type != "cuda":
        return f"the tensors are on {q.device}, the kernels run on CUDA"
    dtype = _autocast_dtype(q) or q.dtype
    if dtype not in custom_ops.KERNEL_DTYPES:
        return f"dtype {dtype} has no kernel (float16, bfloat16 and float32 do)"
    if custom_ops.extension() is None:
        return "the CUDA extension with the mLSTM kernels is not loaded"
    B, NH = q.shape[0], q.shape[1]
    if B * NH > 65535:
        return f"B * NH = {B * NH} exceeds the kernels' grid (65535)"
    if not torch.compiler.is_compiling():  # traced calls meet the same check inside the custom ops
        failure = custom_ops.kernel_failure(q.device)
        if failure is not None:
            return f"the kernels failed their first-use check against the reference ({failure})"
    return None


def _autocast_dtype(q: Tensor) -> Optional[torch.dtype]:
    if q.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _kernel_operands(q, k, v, igate, fgate):
    """q, k, v contiguous in one dtype (autocast's, if on); gates in that dtype or float32."""
    dtype = _autocast_dtype(q) or q.dtype
    q, k, v = (t.to(dtype).contiguous() for t in (q, k, v))
    gate_dtype = igate.dtype if igate.dtype in (dtype, torch.float32) and fgate.dtype == igate.dtype else torch.float32
    return q, k, v, igate.to(gate_dtype).contiguous(), fgate.to(gate_dtype).contiguous()


def _float_state(state: State) -> State:
    return tuple(t.to(torch.float32).contiguous() for t in state)  # type: ignore[return-value]


def mlstm(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, initial_state: Optional[State] = None,
          return_last_state: bool = False, use_fused: bool = True):
    """The mLSTM over whole sequences (chunkwise, O(S) memory).

    Returns h (B, NH, S, DHV) in q's dtype (autocast's under autocast), and with return_last_state also the
    state after the last token (float32; float64 for float64 inputs), which continues the sequence exactly
    as one longer call would: pass it as the next call's initial_state, or to `mlstm_step`."""
    checks.check_sequence(q, k, v, igate, fgate, initial_state)
    if mlstm_unavailable_reason(q, use_fused) is not None:
        return reference.mlstm_chunkwise(q, k, v, igate, fgate, checks.optional_state(initial_state),
                                         return_last_state)
    q, k, v, igate, fgate = _kernel_operands(q, k, v, igate, fgate)
    C0 = n0 = m0 = None
    if initial_state is not None:
        C0, n0, m0 = _float_state(initial_state)
    h, C, n, m, *_ = custom_ops.mlstm_chunkwise_fwd(q, k, v, igate, fgate, C0, n0, m0)
    return (h, (C, n, m)) if return_last_state else h


def _direct_step(q: Tensor, state: State) -> bool:
    """The extension can be called without the custom-op machinery (whose host cost per call is comparable
    to the step kernel's time): no autograd wanted, no tracing, no autocast."""
    return (not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cuda")
            and all(t.dtype == torch.float32 and t.is_contiguous() for t in state))


def mlstm_step(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: State,
               use_fused: bool = True) -> tuple[Tensor, State]:
    """One token per row: q, k (B, NH, DHQK), v (B, NH, DHV), igate, fgate (B, NH), state (C, n, m).
    Returns (h (B, NH, DHV) in q's dtype, the next state in float32 (float64 for float64 inputs))."""
    checks.check_step(q, k, v, igate, fgate, state)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, igate, fgate, *state))
    if wants_grad or mlstm_unavailable_reason(q, use_fused) is not None:
        return reference.mlstm_step(q, k, v, igate, fgate, tuple(state))
    if _direct_step(q, state) and q.is_contiguous() and k.is_contiguous() and v.is_contiguous():
        try:
            h, C, n, m = custom_ops.extension().mlstm_step(q, k, v, igate, fgate, *state)
            return h, (C, n, m)
        except ValueError:
            pass  # an operand the kernel does not take as it is: the path below casts and copies
    q, k, v, igate, fgate = _kernel_operands(q, k, v, igate, fgate)
    h, C, n, m = custom_ops.mlstm_step(q, k, v, igate, fgate, *_float_state(state))
    return h, (C, n, m)
