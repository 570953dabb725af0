"""The Hyena mixer (order 2): gated long convolution with an implicit filter (DESIGN §7).

    z = in_proj(x)  (3 x dim channels)  ->  causal depthwise short conv  ->  q, k, v
    u = k ⊙ v,   y = q ⊙ ( conv(u, h) + D ⊙ u )

The long filter h (dim x max_length) is implicit: a positional encoding of t through a small MLP with sine
activations, times an exponential decay window. The long convolution is causal (`bem.kernels.fftconv`: an FFT
of size >= 2L, or the CUDA kernel). Padded positions are zeroed before both convolutions, so they contribute
nothing, and left padding does not shift anything (the convolutions depend on t - s only).

Decoding keeps, per row, the short conv's last inputs and the history of u (dim x max_length), plus the
position of the next token: a step costs O(position) time per channel and the history O(max_length) memory.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
import torch.nn as nn

from ...kernels.fftconv import dispatch as fftconv_ops
from .short_conv import CausalShortConv
from .state import MixerState


class _Sin(nn.Module):
    def __init__(self, width: int, frequency: float = 1.0) -> None:
        super().__init__()
        self.frequency = nn.Parameter(torch.full((width,), frequency))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.sin(self.frequency * x)


class ImplicitFilter(nn.Module):
    """h[c, t] = MLP(pos(t))[c] * exp(-|delta_c| t / max_length), t in [0, max_length)."""

    def __init__(self, channels: int, max_length: int, features: int = 33, width: int = 64) -> None:
        # 33 features: t and 16 sine/cosine bands, as Hyena's positional encoding has; with 7 bands the filter
        # was too smooth to single out one lag (the recall experiment's Hyena stayed at chance)
        super().__init__()
        self.max_length = max_length
        self.bands = (features - 1) // 2
        self.mlp = nn.Sequential(nn.Linear(1 + 2 * self.bands, width), _Sin(width), nn.Linear(width, width),
                                 _Sin(width), nn.Linear(width, channels))
        # decay rates from fast (the window falls to 1% within 30% of max_length) to slow (150%)
        target = math.log(1e-2)
        self.register_buffer("decay", torch.linspace(-target / 1.5, -target / 0.3, channels), persistent=False)
        self._kept: Optional[torch.Tensor] = None
        self._kept_key: Optional[tuple] = None

    def _positions(self, length: int, device: torch.device, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        t = torch.arange(length, device=device, dtype=torch.float32) / self.max_length  # (L,)
        bands = torch.arange(1, self.bands + 1, device=device, dtype=torch.float32)
        angle = 2 * math.pi * t[:, None] * bands[None, :]
        features = torch.cat([t[:, None], torch.cos(angle), torch.sin(angle)], dim=-1)
        return features.to(dtype), t

    def forward(self, length: int) -> torch.Tensor:
        """The filter's first `length` taps, (channels, length)."""
        key = None
        if not torch.is_grad_enabled() and not torch.compiler.is_compiling():
            key = (length, *(p._version for p in self.parameters()), *(p.data_ptr() for p in self.parameters()))
            if key == self._kept_key:
                return self._kept  # at inference the filter changes only with the weights
        weight = self.mlp[0].weight
        features, t = self._positions(length, weight.device, weight.dtype)
        window = torch.exp(-t[None, :] * self.decay[:, None].to(torch.float32))
        taps = (self.mlp(features).t().to(torch.float32) * window).to(weight.dtype)
        if key is not None:
            self._kept, self._kept_key = taps, key
        return taps


class HyenaMixer(nn.Module):
    """x (B, T, hidden) -> y (B, T, dim); a decode state of (short-conv tail, history of u, position)."""

    def __init__(self, hidden: int, dim: int, max_length: int, conv_size: int, use_fused_kernels: bool) -> None:
        super().__init__()
        self.dim, self.max_length = dim, max_length
        self.use_fused_kernels = use_fused_kernels
        self.in_proj = nn.Linear(hidden, 3 * dim)
        self.short_conv = CausalShortConv(3 * dim, conv_size)
        self.filter = ImplicitFilter(dim, max_length)
        self.D = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], state: Optional[MixerState],
                want_state: bool) -> tuple[torch.Tensor, Optional[MixerState]]:
        B, T, _ = x.shape
        z = self.in_proj(x).transpose(1, 2)  # (B, 3 dim, T)
        real = None if mask is None else (mask != 0).to(z.dtype)[:, None, :]
        if real is not None:
            z = z * real
        z, tail = self.short_conv(z, None if state is None else state.rows["conv_tail"])
        q, k, v = z.split(self.dim, dim=1)
        u = k * v if real is None else k * v * real
        if state is None:
            y = self._long_conv(u, self.filter(T), q)
            new_state = self._first_state(u, tail) if want_state else None
        else:
            y, new_state = self._continue(u, q, tail, state)
        return y.transpose(1, 2), new_state

    def _long_conv(self, u: torch.Tensor, taps: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
        """q ⊙ (conv(u, taps) + D ⊙ u). Off CUDA in float64: an FFT's rounding grows with the length and the
        values, and the CPU path is the one whose cached decoding must match the full forward to 1e-5."""
        if u.is_cuda:
            return fftconv_ops.fftconv(u, taps, self.D, postgate=q, use_fused=self.use_fused_kernels)
        exact = fftconv_ops.fftconv(u.double(), taps.double(), self.D.double(), postgate=q.double(), use_fused=False)
        return exact.to(u.dtype)

    def _first_state(self, u: torch.Tensor, tail: torch.Tensor) -> MixerState:
        B, _, T = u.shape
        history = u.new_zeros(B, self.dim, self.max_length)
        history[:, :, :T] = u
        position = torch.tensor(T, dtype=torch.long, device=u.device)
        return MixerState({"conv_tail": tail, "history": history}, {"position": position})

    def _continue(self, u: torch.Tensor, q: torch.Tensor, tail: torch.Tensor,
                  state: MixerState) -> tuple[torch.Tensor, MixerState]:
        """New tokens after the state: u and q (B, dim, T). The history is written in place."""
        history, position = state.rows["history"], state.shared["position"]
        T = u.shape[-1]
        taps = self.filter(self.max_length)
        if T == 1 and fftconv_ops.step_unavailable_reason(history, u[:, :, 0], taps, self.use_fused_kernels) is None:
            y = fftconv_ops.fftconv_step(history, u[:, :, 0], taps, position, self.D, postgate=q[:, :, 0])[:, :, None]
        else:
            y = self._continue_by_indexing(u, q, taps, history, position)
        rows = {"conv_tail": tail, "history": history}
        return y, MixerState(rows, {"position": position + T})

    def _continue_by_indexing(self, u: torch.Tensor, q: torch.Tensor, taps: torch.Tensor, history: torch.Tensor,
                              position: torch.Tensor) -> torch.Tensor:
        """The new outputs from the whole history, with the position as a tensor (no host sync, traceable):
        for one token a dot product with the filter reversed at the position; for more, one long convolution."""
        T, L = u.shape[-1], self.max_length
        where = position + torch.arange(T, device=u.device)
        history.index_copy_(2, where, u.to(history.dtype))
        acc = torch.float32 if u.is_cuda else torch.float64  # as `_long_conv`
        if T == 1:
            lag = position - torch.arange(L, device=u.device)  # t - s for every kept s
            reversed_taps = torch.where(lag >= 0, taps.to(acc)[:, lag.clamp(min=0)], 0.0)  # (dim, L)
            conv = (history.to(acc) * reversed_taps).sum(-1, keepdim=True)  # (B, dim, 1)
        else:
            whole = fftconv_ops.fftconv(history.to(acc), taps.to(acc), use_fused=self.use_fused_kernels and u.is_cuda)
            conv = whole.index_select(2, where).to(acc)
        y = q.to(acc) * (conv + self.D.to(acc)[:, None] * u.to(acc))
        return y.to(u.dtype)
