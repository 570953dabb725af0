"""The causal depthwise short convolution both mixers put in front of their sequence mixing, with its decode
state: the last `size - 1` inputs of each channel."""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F


class CausalShortConv(nn.Module):
    """y_t = sum_{j < size} w[c, j] x_{t - size + 1 + j} + b[c] per channel c, over x (B, C, T); positions before
    the sequence (or before the kept tail) are zero."""

    def __init__(self, channels: int, size: int) -> None:
        super().__init__()
        self.size = size
        self.weight = nn.Parameter(torch.empty(channels, size))
        self.bias = nn.Parameter(torch.zeros(channels))
        nn.init.kaiming_uniform_(self.weight.view(channels, 1, size), a=5 ** 0.5)

    def forward(self, x: torch.Tensor, tail: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, torch.Tensor]:
        """(y (B, C, T), the new tail (B, C, size - 1)): `tail` holds the inputs before x (None: zeros)."""
        B, C, T = x.shape
        if tail is None:
            tail = x.new_zeros(B, C, self.size - 1)
        joined = torch.cat([tail.to(x.dtype), x], dim=-1)
        y = F.conv1d(joined, self.weight.to(x.dtype).unsqueeze(1), self.bias.to(x.dtype), groups=C)
        return y, joined[:, :, joined.shape[-1] - (self.size - 1):]
