"""The single dispatch point between the fused CUDA kernels and the PyTorch reference.

Modules call `generated_update` / `bem_linear` here and never choose a backend themselves. The
kernels run when the extension loaded, `use_fused` is true and the case is one they take
(`fused_unavailable_reason` says why not otherwise); every other call runs `reference.py`.
"""

from __future__ import annotations

import os
from typing import Optional

import torch

from . import custom_ops, reference


# Whether the CUDA extension `bem._C` (prebuilt or just-in-time) loaded: None until first looked up, which may
# build the extension, so never at import. Read it as `KERNELS_AVAILABLE` (a bool) or `kernels_available()`.
_available: Optional[bool] = None


def kernels_available() -> bool:
    global _available
    if _available is None:
        _available = custom_ops.extension() is not None
    return _available


def __getattr__(name: str):
    if name == "KERNELS_AVAILABLE":
        return kernels_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
HALF_DTYPES = (torch.float16, torch.bfloat16)
# BEM_FUSED_TRAINING=0: autograd at prefill sizes takes the reference path (cuBLAS forward and backward).
# The fused ops are the default there: in a bf16 training step of a 1B model they measured faster once the
# backward's dX came from the fused GEMM (docs/kernels.md).
TRAINING_USES_REFERENCE = os.environ.get("BEM_FUSED_TRAINING", "1") == "0"
MAX_FUSED_RANK = 128


def _check_update_args(x: torch.Tensor, V: torch.Tensor, codes: Optional[torch.Tensor], U: torch.Tensor) -> None:
    if V.dim() != 2 or U.dim() != 2:
        raise ValueError(f"V and U must be 2-D (K x r, N x r); got V {tuple(V.shape)}, U {tuple(U.shape)}")
    K, r = V.shape
    if U.shape[1] != r:
        raise ValueError(f"rank mismatch: V is {tuple(V.shape)} (K x r) but U is {tuple(U.shape)} (N x r)")
    if x.shape[-1] != K:
        raise ValueError(f"input has {x.shape[-1]} features in its last dimension, V expects K={K}")
    if codes is not None and tuple(codes.shape) != tuple(x.shape[:-1]) + (r,):
        raise ValueError(
            f"codes must have shape {tuple(x.shape[:-1]) + (r,)} (input's leading dims + rank); "
            f"got {tuple(codes.shape)}"
        )
    _check_same_kind(x, {"V": V, "U": U, "codes": codes})


def _check_same_kind(x: torch.Tensor, others: dict[str, Optional[torch.Tensor]]) -> None:
    """Every operand shares x's device and dtype (autocast casts before this point)."""
    for name, tensor in others.items():
        if tensor is None:
            continue
        if tensor.device != x.device:
            raise ValueError(f"{name} is on {tensor.device} but the input x is on {x.device}")
        if tensor.dtype != x.dtype:
            raise ValueError(f"{name} has dtype {tensor.dtype} but the input x has {x.dtype}; cast them to one dtype")


def _check_weight(x: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor], V, U) -> None:
    if weight.shape != (U.shape[0], V.shape[0]):
        raise ValueError(
            f"weight must be (N, K) = ({U.shape[0]}, {V.shape[0]}) to match U and V; got {tuple(weight.shape)}"
        )
    if bias is not None and tuple(bias.shape) != (U.shape[0],):
        raise ValueError(f"bias must be (N,) = ({U.shape[0]},); got {tuple(bias.shape)}")
    _check_same_kind(x, {"weight": weight, "bias": bias})


def fused_unavailable_reason(
    x: torch.Tensor,
    V: torch.Tensor,
    use_fused: bool = True,
    weight: Optional[torch.Tensor] = None,
    bias: Optional[torch.Tensor] = None,
) -> Optional[str]:
    """None when the fused kernels take this call, else why the reference runs instead."""
    if not use_fused:
        return "use_fused is False"
    if x.device.type != "cuda":
        return f"the tensors are on {x.device}, the kernels run on CUDA"
    if not kernels_available():
        return "the CUDA extension bem._C is not loaded"
    if _autocast_dtype(x) is None and x.dtype not in FUSED_DTYPES:
        return f"dtype {x.dtype} has no kernel"
    if V.shape[1] > MAX_FUSED_RANK:
        return f"rank {V.shape[1]} exceeds the kernels' maximum of {MAX_FUSED_RANK}"
    if x.numel() == 0:
        return "the input is empty"
    if (weight is not None and weight.requires_grad) or (bias is not None and bias.requires_grad):
        return "the frozen weight or bias requires grad (the kernels never compute dW or db)"
    if TRAINING_USES_REFERENCE and torch.is_grad_enabled() and x.shape[:-1].numel() > custom_ops.decode_max_tokens():
        return "autograd at prefill sizes: BEM_FUSED_TRAINING=0 asks for the reference path there"
    return None


def _autocast_dtype(x: torch.Tensor) -> Optional[torch.dtype]:
    if x.device.type == "cuda" and torch.is_autocast_enabled("cuda"):
        return torch.get_autocast_dtype("cuda")
    return None


def _cast(dtype: Optional[torch.dtype], *tensors: Optional[torch.Tensor]) -> tuple[Optional[torch.Tensor], ...]:
    if dtype is None:
        return tensors
    return tuple(None if t is None else t.to(dtype) for t in tensors)


def _flatten(x: torch.Tensor, codes: Optional[torch.Tensor], r: int) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    # The kernels take row-major 2-D operands; reshape copies only inputs that are not already so.
    x2 = x.reshape(-1, x.shape[-1]).contiguous()
    codes2 = None if codes is None else codes.reshape(-1, r).contiguous()
    return x2, codes2


def generated_update(
    x: torch.Tensor,
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
    use_fused: bool = True,
) -> torch.Tensor:
    """`s * ((x V) ⊙ codes) U^T`; x (..., K), V (K, r), codes (..., r) or None (all ones), U (N, r)."""
    autocast_dtype = _autocast_dtype(x) if use_fused else None
    if autocast_dtype is None:
        _check_update_args(x, V, codes, U)
    if fused_unavailable_reason(x, V, use_fused) is not None:
        return reference.generated_update(x, V, codes, U, scaling)
    x, V, codes, U = _cast(autocast_dtype, x, V, codes, U)
    _check_update_args(x, V, codes, U)
    x2, codes2 = _flatten(x, codes, V.shape[1])
    y, _ = custom_ops.fused_generated_update(x2, V.contiguous(), codes2, U.contiguous(), float(scaling))
    return y.reshape(*x.shape[:-1], U.shape[0])


def _inference_call(x: torch.Tensor, V: torch.Tensor) -> bool:
    """True when the extension can be called directly: no autograd, no tracing, no autocast, a fused
    dtype on CUDA. This skips the custom-op machinery and the Python-side checks, whose host cost per
    call would otherwise dominate at decode sizes, where generation is bound by host time; the extension
    checks every operand itself before anything runs, and refuses with ValueError what it does not take
    as it is."""
    return (
        x.is_cuda and custom_ops.extension() is not None and not torch.is_grad_enabled()
        and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cuda")
        and x.dtype in FUSED_DTYPES and V.shape[-1] <= MAX_FUSED_RANK
    )


def _eager_autograd_call(x: torch.Tensor, V: torch.Tensor, weight: torch.Tensor, bias: Optional[torch.Tensor]) -> bool:
    """True when autograd can run the fused linear straight on the extension's autograd function
    (`_C.fused_linear`, its backward in C++):
    no tracing, no autocast, a non-empty float16/bfloat16 input on CUDA, a frozen weight and bias, and the
    fused training path not opted out of (BEM_FUSED_TRAINING=0) at this size. The extension refuses, with
    ValueError, any operand it does not take as it is; the checked path below then copies, casts or explains."""
    return (
        x.is_cuda and x.dtype in HALF_DTYPES and torch.is_grad_enabled() and custom_ops.extension() is not None
        and not torch.compiler.is_compiling() and not torch.is_autocast_enabled("cuda") and x.numel() != 0
        and V.shape[-1] <= MAX_FUSED_RANK and not weight.requires_grad and (bias is None or not bias.requires_grad)
        and not (TRAINING_USES_REFERENCE and x.shape[:-1].numel() > custom_ops.decode_max_tokens())
    )


class TransposeKeeper:
    """V^T, (r, K) and contiguous, as the TMA update kernel and the GEMM with the update inside read it:
    copied once and kept until V changes (in place: its version counter; replaced: its address). Each
    wrapped layer owns one, for its own V. Without it the extension copies V on every call that takes
    those kernels (one more launch; at a 1024-token prompt, when the update kernel there still read V^T,
    8 of the call's 29 µs of host time on an H200 machine)."""

    def __init__(self) -> None:
        self._kept: Optional[torch.Tensor] = None
        self._key: Optional[tuple] = None

    def get(self, V: torch.Tensor) -> Optional[torch.Tensor]:
        if V.is_inference():
            return None  # made inside inference mode: no version counter to tell an in-place change by
        key = (V._version, V.data_ptr(), V.dtype)
        if self._key != key:
            with torch.inference_mode(False):  # a normal tensor: usable outside inference mode too
                self._kept = V.detach().t().contiguous()
            self._key = key
        return self._kept


def direct_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
    v_t: Optional[TransposeKeeper],
) -> Optional[torch.Tensor]:
    """The fused linear from the extension called directly (after `_inference_call`), or None where the
    extension refuses an operand as it is (ValueError): the caller's checked path then copies, casts or
    explains."""
    prefill_sized = x.numel() > custom_ops.decode_auto_max_tokens() * x.shape[-1]
    V_t = v_t.get(V) if v_t is not None and prefill_sized else None
    try:
        # positional (mode 0: by shape; split 0: by shape; no x V): pybind matches keywords slower
        return custom_ops._C.linear_forward(x, weight, bias, V, codes, U, float(scaling), 0, 0, False, V_t)[0]
    except ValueError:
        return None


def bem_linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: Optional[torch.Tensor],
    V: torch.Tensor,
    codes: Optional[torch.Tensor],
    U: torch.Tensor,
    scaling: float,
    use_fused: bool = True,
    v_t: Optional[TransposeKeeper] = None,
) -> torch.Tensor:
    """`x W^T + b + s * ((x V) ⊙ codes) U^T`, W: (N, K) (a transposed view of a (K, N) tensor is fine).

    v_t: the caller's keeper of this V's transpose; the direct inference call hands V^T to the kernels
    that read it (above the decode kernels' rows, which read V itself)."""
    if use_fused and _inference_call(x, V):
        y = direct_linear(x, weight, bias, V, codes, U, scaling, v_t)
        if y is not None:
            return y
    if use_fused and _eager_autograd_call(x, V, weight, bias):
        try:
            return custom_ops._C.fused_linear(x, weight, bias, V, codes, U, float(scaling))
        except ValueError:
            pass  # as above
    autocast_dtype = _autocast_dtype(x) if use_fused else None
    if autocast_dtype is None:
        _check_update_args(x, V, codes, U)
        _check_weight(x, weight, bias, V, U)
    if fused_unavailable_reason(x, V, use_fused, weight, bias) is not None:
        return reference.bem_linear(x, weight, bias, V, codes, U, scaling)
    x, weight, bias, V, codes, U = _cast(autocast_dtype, x, weight, bias, V, codes, U)
    _check_update_args(x, V, codes, U)
    _check_weight(x, weight, bias, V, U)
    if not (weight.is_contiguous() or weight.t().is_contiguous()):
        weight = weight.contiguous()  # neither row-major nor a transposed row-major buffer: one copy
    x2, codes2 = _flatten(x, codes, V.shape[1])
    bias = None if bias is None else bias.contiguous()
    operands = (x2, weight, bias, V.contiguous(), codes2, U.contiguous(), float(scaling))
    if not torch.is_grad_enabled() or not any(t is not None and t.requires_grad for t in operands[:6]):
        y = custom_ops.bem_linear_inference(*operands)  # no x V kept for a backward that will not come
    else:
        y, _ = custom_ops.fused_bem_linear(*operands)
    return y.reshape(*x.shape[:-1], U.shape[0])
