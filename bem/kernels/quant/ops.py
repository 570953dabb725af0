"""When a wrapped 4-bit layer's call takes BEM's 4-bit path, and what the extension is handed.

The path takes calls in float16 or bfloat16 on CUDA, outside torch.compile, of a bitsandbytes `Linear4bit` whose
compute dtype is x's, stored as uint8 (not FSDP's float storage), with K a multiple of 32 and a bias that is not
trained. Inference calls of up to 4 rows (up to `QUANT4_DECODE_MAX_TOKENS` on weights of at most
`WIDE_ROWS_MAX_VALUES` values) take the decode kernel, which reads the packed weight itself; every other call
dequantizes the weight to x's dtype (as bitsandbytes' layer does above one row) and runs the low-rank family's GEMM
with the update inside, under autograd where a gradient is wanted (for x, V, U and the codes; the backward
dequantizes again, so no 16-bit weight is kept). Everything else returns None: the caller runs the layer as it is
and adds the update beside it."""

from __future__ import annotations

import weakref
from typing import Optional

import torch
import torch.nn as nn
from torch import Tensor

from .. import custom_ops
from .reference import Quant4Weight

KERNEL_DTYPES = (torch.float16, torch.bfloat16)


def quant4_weight(layer: nn.Module) -> Optional[Quant4Weight]:
    """The 4-bit weight of a bitsandbytes `Linear4bit` as the kernel reads it, or None for any other layer (or a
    state this code does not recognise: it fails closed)."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    if state is None or type(weight).__name__ != "Params4bit":
        return None
    return weight_from_state(weight.data, state)


def weight_from_state(packed: Tensor, state: object) -> Optional[Quant4Weight]:
    """A packed 4-bit weight and its bitsandbytes `QuantState` as the kernel reads them, or None where the state is
    not one this code recognises."""
    if packed.dtype != torch.uint8:
        return None
    shape = tuple(getattr(state, "shape", ()) or ())
    code, absmax = getattr(state, "code", None), getattr(state, "absmax", None)
    blocksize = getattr(state, "blocksize", 0)
    if len(shape) != 2 or code is None or absmax is None or code.numel() != 16 or not isinstance(blocksize, int):
        return None
    N, K = shape
    if packed.numel() * 2 != N * K:
        return None
    nested = getattr(state, "nested", False)
    state2 = getattr(state, "state2", None) if nested else None
    if nested and state2 is None:
        return None
    offset = getattr(state, "offset", None)
    return Quant4Weight(
        packed=packed, absmax=absmax, code=code, blocksize=blocksize, out_features=N, in_features=K,
        absmax2=None if state2 is None else state2.absmax, code2=None if state2 is None else state2.code,
        offset=float(offset) if offset is not None else 0.0, blocksize2=0 if state2 is None else int(state2.blocksize))


# Each layer's weight as the kernel reads it, and the key it was read under: reading it anew each call would cost
# host time, and the double-quantization offset (a device scalar) a synchronisation
_KEPT: "weakref.WeakKeyDictionary[nn.Module, tuple[tuple, Optional[Quant4Weight]]]" = weakref.WeakKeyDictionary()
_MAX_TOKENS: list[int] = []


def kept_weight(layer: nn.Module) -> Optional[Quant4Weight]:
    """`quant4_weight(layer)`, read again only when the layer's weight or its quantization state was replaced."""
    weight = getattr(layer, "weight", None)
    state = getattr(weight, "quant_state", None)
    key = (None if weight is None else weight.data_ptr(), id(state),
           None if state is None else getattr(getattr(state, "absmax", None), "data_ptr", lambda: None)())
    kept = _KEPT.get(layer)
    if kept is None or kept[0] != key:
        kept = (key, quant4_weight(layer))
        _KEPT[layer] = kept
    return kept[1]


def _max_tokens() -> int:
    if not _MAX_TOKENS:
        found = custom_ops.extension()
        if found is None:
            return 0
        _MAX_TOKENS.append(int(getattr(found, "QUANT4_DECODE_MAX_TOKENS", 0)))
    return _MAX_TOKENS[0]


def takes(layer: nn.Module, x: Tensor, V: Tensor, U: Tensor) -> bool:
    """Whether the 4-bit path takes this call (see the module's docstring; the weight itself is checked apart)."""
    if not x.is_cuda or x.dtype not in KERNEL_DTYPES or V.dtype != x.dtype or U.dtype != x.dtype:
        return False
    if torch.compiler.is_compiling() or custom_ops.extension() is None:
        return False
    compute_dtype = getattr(layer, "compute_dtype", None)
    if compute_dtype is not None and compute_dtype != x.dtype:
        return False
    return x.numel() > 0 and x.shape[-1] % 32 == 0


def wants_grad(x: Tensor, V: Tensor, U: Tensor, codes: Optional[Tensor]) -> bool:
    return torch.is_grad_enabled() and (x.requires_grad or V.requires_grad or U.requires_grad
                                        or (codes is not None and codes.requires_grad))


# Above 4 rows the kernel's CUDA-core products cost more than bitsandbytes' dequantize-and-GEMM plus the update on
# large weights (H200, eager, 16 rows: 4096 x 14336 took 224 µs against 122, 4096 x 4096 81 against 169), so it
# takes 5-16 rows only up to this many weight values.
WIDE_ROWS_MAX_VALUES = 4096 * 4096


def takes_shape(rows: int, weight: Quant4Weight) -> bool:
    return rows <= 4 or weight.out_features * weight.in_features <= WIDE_ROWS_MAX_VALUES


def fused_linear(layer: nn.Module, x: Tensor, V: Tensor, codes: Optional[Tensor], U: Tensor,
                 scaling: float) -> Optional[Tensor]:
    """layer(x) + s ((x V) ⊙ codes) Uᵀ from the extension, or None where the 4-bit path does not take the call.
    codes: laid out as x ((..., r) for x (..., K)) or None."""
    if not takes(layer, x, V, U):
        return None
    weight = kept_weight(layer)
    if weight is None or weight.in_features != x.shape[-1] or weight.packed.device != x.device:
        return None
    bias = getattr(layer, "bias", None)
    if bias is not None:
        if bias.requires_grad and torch.is_grad_enabled():
            return None  # a trained bias: the layer's own forward gives it its gradient
        bias = bias.to(x.dtype)
    rows = x.numel() // weight.in_features
    grad = wants_grad(x, V, U, codes)
    codes = None if codes is None else codes.to(x.dtype).contiguous()
    if not grad and rows <= _max_tokens() and takes_shape(rows, weight):
        x2 = x.reshape(rows, weight.in_features).contiguous()
        codes2 = None if codes is None else codes.reshape(rows, -1)
        y = kernel_call(weight, x2, bias, V.contiguous(), codes2, U.contiguous(), scaling)
        return y.reshape(*x.shape[:-1], weight.out_features)
    call = custom_ops.extension().quant4_fused_linear if grad else custom_ops.extension().quant4_linear
    return call(x.contiguous(), *weight.layout_args(), bias, V.contiguous(), codes, U.contiguous(), float(scaling))


def kernel_call(weight: Quant4Weight, x: Tensor, bias: Optional[Tensor], V: Tensor, codes: Optional[Tensor],
                U: Tensor, scaling: float) -> Tensor:
    """The kernel itself on 2-D operands (x (M, K), codes (M, r)), whatever the dispatch rule would say."""
    return custom_ops.extension().quant4_linear_decode(x, *weight.layout_args(), bias, V, codes, U, float(scaling))
