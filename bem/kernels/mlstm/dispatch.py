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


def _fast_step(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: State):
    """The step kernel called straight through the extension for operands it takes as they are (contiguous, its
    dtypes; its C++ checks refuse anything else), or None where the general path must run (it checks in
    Python, casts, copies or takes the reference).
    Decoding calls this once per mixer and token: the custom op's dispatch and the Python checks cost several
    times the kernel's 4.6 µs. Not while tracing (the custom op is what compiles), under autocast (the general
    path casts), with gradients wanted (the reference has them), or before the first-use check passed."""
    if not q.is_cuda or torch.compiler.is_compiling() or torch.is_autocast_enabled("cuda"):
        return None
    operands = (q, k, v, igate, fgate, *state)
    if not all(isinstance(t, Tensor) and t.is_contiguous() for t in operands):
        return None  # views (a token sliced out of a sequence) are copied by the general path
    dtype = q.dtype
    if (dtype not in custom_ops.KERNEL_DTYPES or k.dtype != dtype or v.dtype != dtype or igate.dtype != fgate.dtype
            or igate.dtype not in (dtype, torch.float32) or any(t.dtype != torch.float32 for t in state)):
        return None  # cast by the general path
    if torch.is_grad_enabled() and any(t.requires_grad for t in operands):
        return None
    ext = custom_ops.extension()
    if ext is None or custom_ops.kernel_failure(q.device) is not None:
        return None
    try:
        h, C, n, m = ext.mlstm_step(q, k, v, igate, fgate, *state)
    except (ValueError, TypeError):
        return None  # a bad operand (a shape, a device): the general path says which in Python
    return h, (C, n, m)


def mlstm_step(q: Tensor, k: Tensor, v: Tensor, igate: Tensor, fgate: Tensor, state: State,
               use_fused: bool = True) -> tuple[Tensor, State]:
    """One token per row: q, k (B, NH, DHQK), v (B, NH, DHV), igate, fgate (B, NH), state (C, n, m).
    Returns (h (B, NH, DHV) in q's dtype, the next state in float32 (float64 for float64 inputs))."""
    if use_fused and isinstance(q, Tensor) and isinstance(state, (tuple, list)) and len(state) == 3:
        fast = _fast_step(q, k, v, igate, fgate, state)
        if fast is not None:
            return fast
    checks.check_step(q, k, v, igate, fgate, state)
    wants_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, igate, fgate, *state))
    if wants_grad or mlstm_unavailable_reason(q, use_fused) is not None:
        return reference.mlstm_step(q, k, v, igate, fgate, tuple(state))
    q, k, v, igate, fgate = _kernel_operands(q, k, v, igate, fgate)
    h, C, n, m = custom_ops.mlstm_step(q, k, v, igate, fgate, *_float_state(state))
    return h, (C, n, m)
