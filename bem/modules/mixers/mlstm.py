"""The mLSTM mixer: xLSTM's matrix memory in its stabilised parallel ("vLSTM") form (DESIGN §7).

    z = in_proj(x),  c = silu(short_conv(z)),  q = W_q c,  k = W_k c,  v = W_v z
    ĩ, f̃ = W_gates x (per head),  h = mLSTM(q, k, v, ĩ, f̃)  (`bem.kernels.mlstm`)
    y = headnorm(h) ⊙ sigmoid(W_o x)

Padded positions write nothing into the memory (their keys are zeroed) and do not decay it (their forget gate
pre-activation is set high, their input gate's low), so padding contributes nothing and left padding changes
nothing. Decoding keeps, per row, the memory (C, n, m) in float32 and the short conv's last inputs: a step costs
O(dim x head_dim) whatever the context length.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ...kernels.mlstm import dispatch as mlstm_ops
from .short_conv import CausalShortConv
from .state import MixerState

# gate pre-activations at padded positions: log σ(30) is -1e-13 (no decay), exp(-30) writes nothing
PAD_FORGET, PAD_INPUT = 30.0, -30.0


class MLSTMMixer(nn.Module):
    """x (B, T, hidden) -> y (B, T, dim) with `heads` heads of dim / heads; a decode state (C, n, m, tail)."""

    def __init__(self, hidden: int, dim: int, heads: int, conv_size: int, forget_bias: float, input_bias: float,
                 use_fused_kernels: bool) -> None:
        super().__init__()
        self.dim, self.heads, self.head_dim = dim, heads, dim // heads
        self.use_fused_kernels = use_fused_kernels
        self.in_proj = nn.Linear(hidden, dim)
        self.short_conv = CausalShortConv(dim, conv_size)
        self.q_proj = nn.Linear(dim, dim, bias=False)
        self.k_proj = nn.Linear(dim, dim, bias=False)
        self.v_proj = nn.Linear(dim, dim, bias=False)
        self.gates = nn.Linear(hidden, 2 * heads)
        self.out_gate = nn.Linear(hidden, dim)
        self.head_norm_weight = nn.Parameter(torch.ones(dim))
        with torch.no_grad():  # xLSTM's initialisation: forget gates open (one bias per head), inputs neutral
            self.gates.weight.zero_()
            self.gates.bias[:heads].fill_(input_bias)
            self.gates.bias[heads:].copy_(torch.linspace(forget_bias, forget_bias + 3.0, heads))

    def _heads(self, t: torch.Tensor) -> torch.Tensor:
        B, T, _ = t.shape
        return t.view(B, T, self.heads, self.head_dim).transpose(1, 2)  # (B, NH, T, DH)

    def forward(self, x: torch.Tensor, mask: Optional[torch.Tensor], state: Optional[MixerState],
                want_state: bool) -> tuple[torch.Tensor, Optional[MixerState]]:
        B, T, _ = x.shape
        z = self.in_proj(x)
        real = None if mask is None else (mask != 0)
        if real is not None:
            z = z * real[..., None].to(z.dtype)
        conv, tail = self.short_conv(z.transpose(1, 2), None if state is None else state.rows["conv_tail"])
        c = F.silu(conv.transpose(1, 2))
        q, k, v = self._heads(self.q_proj(c)), self._heads(self.k_proj(c)), self._heads(self.v_proj(z))
        igate, fgate = self.gates(x).transpose(1, 2).split(self.heads, dim=1)  # (B, NH, T) each
        if real is not None:
            keep = real[:, None, :]
            k = k * keep[..., None].to(k.dtype)
            igate = torch.where(keep, igate, torch.full_like(igate, PAD_INPUT))
            fgate = torch.where(keep, fgate, torch.full_like(fgate, PAD_FORGET))
        memory = None if state is None else (state.rows["C"], state.rows["n"], state.rows["m"])
        h, memory = self._memory(q, k, v, igate, fgate, memory, want_state)
        y = self._head_norm(h).transpose(1, 2).reshape(B, T, self.dim) * torch.sigmoid(self.out_gate(x))
        new_state = None
        if want_state:
            C, n, m = memory
            new_state = MixerState({"C": C, "n": n, "m": m, "conv_tail": tail})
        return y, new_state

    def _memory(self, q, k, v, igate, fgate, memory, want_state: bool):
        """h (B, NH, T, DH) in q's dtype and the memory after the tokens (None unless wanted). Off CUDA in
        float64 (the memory too): the parallel form inside chunks and the recurrent step round differently, and
        the CPU path is the one whose cached decoding must match the full forward to 1e-5."""
        dtype = q.dtype
        if not q.is_cuda:
            q, k, v, igate, fgate = (t.double() for t in (q, k, v, igate, fgate))
        if memory is not None and q.shape[2] == 1:
            h, memory = mlstm_ops.mlstm_step(q[:, :, 0], k[:, :, 0], v[:, :, 0], igate[:, :, 0], fgate[:, :, 0],
                                             memory, use_fused=self.use_fused_kernels)
            return h[:, :, None].to(dtype), memory
        out = mlstm_ops.mlstm(q, k, v, igate, fgate, initial_state=memory, return_last_state=want_state,
                              use_fused=self.use_fused_kernels)
        h, memory = out if want_state else (out, None)
        return h.to(dtype), memory

    def _head_norm(self, h: torch.Tensor) -> torch.Tensor:
        """RMS norm over each head's channels, then a learned scale per channel."""
        h32 = h.to(torch.float32)
        normed = h32 * torch.rsqrt(h32.pow(2).mean(-1, keepdim=True) + 1e-6)
        weight = self.head_norm_weight.view(self.heads, 1, self.head_dim).to(torch.float32)
        return (normed * weight).to(h.dtype)
