"""bitsandbytes' 4-bit weight layout in PyTorch: W (N x K) flattened row by row, two values a byte (the first in
the high nibble), value e = code[nibble] * absmax(e // blocksize); with double quantization the per-block absmax
is itself 8-bit: code2[absmax_u8[b]] * absmax2[b // blocksize2] + offset."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor


@dataclass(frozen=True)
class Quant4Weight:
    """A 4-bit frozen weight as the kernel reads it (the tensors are the layer's own, not copies)."""

    packed: Tensor                  # uint8, N * K / 2 values
    absmax: Tensor                  # float32 per block, or uint8 with double quantization
    code: Tensor                    # float32 (16,)
    blocksize: int
    out_features: int               # N
    in_features: int                # K
    absmax2: Optional[Tensor] = None  # float32 per blocksize2 blocks of absmax (double quantization)
    code2: Optional[Tensor] = None    # float32 (256,)
    offset: float = 0.0
    blocksize2: int = 0

    def layout_args(self) -> tuple:
        """The weight's arguments of the extension's 4-bit calls, in their order (weight through out_features)."""
        return (self.packed, self.absmax, self.code, self.absmax2, self.code2, self.offset, self.blocksize,
                self.blocksize2, self.out_features)


def block_absmax(weight: Quant4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """Each block's absmax in `dtype`, undoing double quantization where there is one."""
    if weight.absmax2 is None:
        return weight.absmax.to(dtype)
    nested = weight.absmax2.to(dtype).repeat_interleave(weight.blocksize2)[: weight.absmax.numel()]
    return weight.code2.to(dtype)[weight.absmax.long()] * nested + weight.offset


def dequantize(weight: Quant4Weight, dtype: torch.dtype = torch.float32) -> Tensor:
    """W (N x K) in `dtype`."""
    flat = weight.packed.reshape(-1)
    nibbles = torch.stack([flat >> 4, flat & 15], dim=1).reshape(-1).long()
    count = weight.out_features * weight.in_features
    scales = block_absmax(weight, dtype).repeat_interleave(weight.blocksize)[:count]
    return (weight.code.to(dtype)[nibbles[:count]] * scales).reshape(weight.out_features, weight.in_features)


def quant4_linear(x: Tensor, weight: Quant4Weight, bias: Optional[Tensor], V: Tensor, codes: Optional[Tensor],
                  U: Tensor, scaling: float, dtype: torch.dtype = torch.float64) -> Tensor:
    """x dequant(W)ᵀ + b + s ((x V) ⊙ codes) Uᵀ computed in `dtype`, returned in x's dtype. x (M, K)."""
    xd = x.to(dtype)
    y = xd @ dequantize(weight, dtype).t()
    h = xd @ V.to(dtype)
    if codes is not None:
        h = h * codes.to(dtype)
    y = y + scaling * (h @ U.to(dtype).t())
    if bias is not None:
        y = y + bias.to(dtype)
    return y.to(x.dtype)
