"""`HierarchicalController`: per-module, per-token codes from prefix, chunk and token context.

    c_{m,t} = g_t * ( c^static_m + clamp_τ( c^prefix_{m,t} + c^chunk_{m,t} + c^token_{m,t} ) )

The controller reads the hidden states entering the first block, projected to `controller_dim`
(z_t). Positions count from each row's first non-padding token. Every level is causal:

- prefix: p_t = mean(z_0 .. z_min(t, P-1)), padding excluded;
- chunk: token t in chunk k = t // C reads e_k, where e_0 = 0 and
  e_k = β e_{k-1} + (1-β) f(mean of chunk k-1, p_{kC-1}) — only strictly earlier chunks;
- token: f_tok(z_t, p_t), for token-routed modules only;
- gate: g_t = sigmoid(w·[z_t, p_t] + b) / temperature-scaled, or 1 when disabled.

Two equivalent ways to run it: `forward` over whole sequences (vectorised), and `step` over new
tokens given a `RoutingState` (prefix sum and count, chunk EMA, open-chunk sum), which is what
makes cached generation give the same codes as a full forward.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Optional

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from .codes_buffer import codes_buffer
from .controller_heads import RoutingLevels, StackedWeights, first_layer, gate_logit, second_layer
from .host_copy import HostCopy, host_copy_applies


def _recomputes_in_backward() -> bool:
    """Eager autograd: the controller's full-size intermediates are recomputed in the backward (checkpoint), not
    kept; traced code leaves that choice to the compiler."""
    return torch.is_grad_enabled() and not torch.compiler.is_compiling()


# Gate bias at init: sigmoid(4) ≈ 0.982, so the gate starts close to one (DESIGN §2).
GATE_INIT_BIAS = 4.0


@dataclass
class RoutingState:
    """Per-row routing state after `count` real tokens; every tensor's first dim is the batch. It rides on the
    KV cache as the "routing" part of BEM's cache state (`bem.cache_state.CarriedState`)."""

    count: torch.Tensor  # (B,) long: real tokens seen
    prefix_sum: torch.Tensor  # (B, d): sum of z over the first min(count, P) real tokens
    chunk_ema: torch.Tensor  # (B, d): e_k for k = count // C, the chunk the next token falls in
    open_sum: torch.Tensor  # (B, d): sum of z over the tokens already in chunk count // C
    side: Optional[torch.Tensor]  # (B, d) projected side signal, or None

    def _map_rows(self, fn) -> "RoutingState":
        values = {f.name: getattr(self, f.name) for f in fields(self)}
        return RoutingState(**{name: fn(v) if torch.is_tensor(v) else v for name, v in values.items()})

    def index_select(self, index: torch.Tensor) -> "RoutingState":
        """Rows reordered or selected (beam search)."""
        return self._map_rows(lambda value: value.index_select(0, index.to(value.device)))

    def repeat_interleave(self, repeats: int) -> "RoutingState":
        return self._map_rows(lambda value: value.repeat_interleave(repeats, 0))

    def tensors(self) -> list[torch.Tensor]:
        return [t for t in (self.count, self.prefix_sum, self.chunk_ema, self.open_sum, self.side) if t is not None]

    def copy_from(self, other: "RoutingState") -> None:
        """Overwrite this state's tensors with another's, in place."""
        for mine, theirs in zip(self.tensors(), other.tensors(), strict=True):
            mine.copy_(theirs)

    @property
    def batch_size(self) -> int:
        return self.count.shape[0]


@dataclass
class RoutingOutput:
    codes: torch.Tensor  # (M, B, T, r) in the requested dtype
    state: Optional[RoutingState]
    levels: Mapping  # gate, codes and (outside training passes) each level's contribution, for routing_stats()


def _head(in_dim: int, hidden: int, out_dim: int) -> nn.Sequential:
    head = nn.Sequential(nn.Linear(in_dim, hidden), nn.GELU(), nn.Linear(hidden, out_dim))
    nn.init.zeros_(head[-1].weight)  # routing heads start at zero: the code starts at g_t * 1
    nn.init.zeros_(head[-1].bias)
    return head


class HierarchicalController(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        num_modules: int,
        rank: int,
        token_module_indices: list[int],
        controller_dim: int = 64,
        chunk_size: int = 32,
        max_prefix_tokens: int = 128,
        ema_decay: float = 0.9,
        code_clamp_value: float = 3.0,
        enable_uncertainty: bool = True,
        enable_token_routing: bool = True,
        side_signal_dim: Optional[int] = None,
    ) -> None:
        super().__init__()
        self.hidden_size, self.num_modules, self.rank = hidden_size, num_modules, rank
        self.chunk_size, self.max_prefix_tokens = chunk_size, max_prefix_tokens
        self.ema_decay, self.code_clamp_value = ema_decay, code_clamp_value
        self.side_signal_dim = side_signal_dim
        d = controller_dim
        self.input_norm = nn.LayerNorm(hidden_size)
        self.input_proj = nn.Linear(hidden_size, d)
        self.static_codes = nn.Parameter(torch.ones(num_modules, rank))
        self.prefix_head = _head(d, d, num_modules * rank)
        self.chunk_summary = nn.Sequential(nn.Linear(2 * d, d), nn.Tanh())
        self.chunk_head = _head(d, d, num_modules * rank)
        self.side_proj = nn.Linear(side_signal_dim, d) if side_signal_dim else None
        token_indices = sorted(set(token_module_indices)) if enable_token_routing else []
        self.register_buffer("token_module_indices", torch.tensor(token_indices, dtype=torch.long), persistent=False)
        self.token_head = _head(2 * d, d, len(token_indices) * rank) if token_indices else None
        if enable_uncertainty:
            self.gate = nn.Linear(2 * d, 1)
            nn.init.zeros_(self.gate.weight)
            nn.init.constant_(self.gate.bias, GATE_INIT_BIAS)
            self.gate_log_temperature = nn.Parameter(torch.zeros(()))
        else:
            self.gate = None
        from .controller_graphs import ControllerGraphs  # CUDA-graph replay of calls at inference

        self.graphs = ControllerGraphs(self)
        self.stacked = StackedWeights()  # the heads' stacked weights at inference (controller_heads)
        self._ema_weights_made: dict[tuple, torch.Tensor] = {}

    # ------------------------------------------------------------------ shared pieces
    def project(self, hidden: torch.Tensor) -> torch.Tensor:
        if not _recomputes_in_backward():
            return self._project(hidden)
        # Under autograd the normalised hidden states (tokens x hidden size, and a float32 copy of the input
        # where the controller is float32 on a bf16 model) are recomputed in the backward instead of kept until
        # it. The input itself goes to host memory until then where it needs no gradient: the first block of
        # an RMSNorm model keeps a float32 copy of it, not the tensor, so on the GPU it would be kept for the
        # controller alone.
        if not host_copy_applies(hidden):
            return checkpoint(self._project, hidden, use_reentrant=False, preserve_rng_state=False)
        kept = HostCopy(hidden)
        z = checkpoint(self._project_kept, kept, use_reentrant=False, preserve_rng_state=False)
        kept.release()
        return z

    def _project(self, hidden: torch.Tensor) -> torch.Tensor:
        params_dtype = self.input_proj.weight.dtype
        return self.input_proj(self.input_norm(hidden.to(params_dtype)))

    def _project_kept(self, kept: HostCopy) -> torch.Tensor:
        return self._project(kept.get())

    def check_side(self, side_signals: Optional[torch.Tensor], batch: int) -> None:
        if self.side_proj is None:
            if side_signals is not None:
                raise ValueError("side_signals were given but the BEM config has side_signal_dim = null")
            return
        if side_signals is None:
            raise ValueError(f"this BEM expects side_signals of shape (batch, {self.side_signal_dim})")
        if side_signals.dim() != 2 or side_signals.shape != (batch, self.side_signal_dim):
            raise ValueError(
                f"side_signals must have shape ({batch}, {self.side_signal_dim}), got {tuple(side_signals.shape)}"
            )

    def project_side(self, side_signals: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
        """The side signals' projection (after check_side)."""
        return None if self.side_proj is None else self.side_proj(side_signals.to(self.side_proj.weight.dtype))

    def clamp_scale(self, dynamic: torch.Tensor) -> torch.Tensor:
        """clamp_τ(v) = v * min(1, τ / ||v||) as that scale over v's last dim, exactly 1 where ||v|| = 0."""
        norm = torch.linalg.vector_norm(dynamic, dim=-1, keepdim=True)
        tau = self.code_clamp_value
        return tau / torch.clamp(norm, min=tau)

    def _combine(self, dynamic: torch.Tensor, gate: Optional[torch.Tensor], out_dtype: torch.dtype) -> torch.Tensor:
        """g * (static + scale * dynamic) as (M, B, T, r) codes in out_dtype, through autograd; dynamic (B, T, M, r)."""
        scale = self.clamp_scale(dynamic)
        if gate is None:
            codes = self.static_codes + dynamic * scale
        else:
            g = gate.unsqueeze(-1)
            codes = torch.addcmul(g * self.static_codes, dynamic, g * scale)
        return codes.permute(2, 0, 1, 3).to(out_dtype).contiguous()

    def _gate(self, first: torch.Tensor, W2: torch.Tensor) -> Optional[torch.Tensor]:
        logit = gate_logit(self, first, W2)
        return None if logit is None else torch.sigmoid(logit / self.gate_log_temperature.exp())

    def _codes_and_gate(self, z: torch.Tensor, p: torch.Tensor, chunk_ctx: torch.Tensor,
                        out_dtype: torch.dtype) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(codes (M, B, T, r) in out_dtype, gate) through autograd."""
        B, T, _ = z.shape
        first, W2, b2 = first_layer(self, z, p, chunk_ctx)  # prefix + chunk (+ token) and the gate, one product
        gate = self._gate(first, W2)
        dynamic = second_layer(first, W2, b2).view(B, T, self.num_modules, self.rank)
        return self._combine(dynamic, gate, out_dtype), gate

    def _codes(self, z: torch.Tensor, p: torch.Tensor, chunk_ctx: torch.Tensor, out_dtype: torch.dtype):
        """Combine the levels for tokens with features z, prefix p and chunk context (all (B, T, d)):
        (codes (M, B, T, r) in out_dtype, levels)."""
        B, T, _ = z.shape
        M, r = self.num_modules, self.rank
        if _recomputes_in_backward():
            # Under autograd both layers of the heads, the gate and the clamp are recomputed in the backward
            # instead of keeping their tensors until it (the full-size float32 ones, tokens x modules x rank, and
            # the first layer's input and output, tokens x 3 controller widths each): only z, p and the chunk
            # context are kept.
            out, gate = checkpoint(self._codes_and_gate, z, p, chunk_ctx, out_dtype, use_reentrant=False,
                                   preserve_rng_state=False)
        elif torch.compiler.is_compiling():
            # traced (with or without autograd): arranged so autograd keeps one full-size tensor (dynamic)
            out, gate = self._codes_and_gate(z, p, chunk_ctx, out_dtype)
            if not torch.is_grad_enabled():  # compiled inference: computed once, not once per module
                out = codes_buffer(out)
        else:
            # no autograd: scale dynamic in place and write the codes straight into their (M, B, T, r) layout and
            # dtype, two full-size passes instead of five
            first, W2, b2 = first_layer(self, z, p, chunk_ctx)
            gate = self._gate(first, W2)
            dynamic = second_layer(first, W2, b2).view(B, T, M, r)
            scale = self.clamp_scale(dynamic)
            out = torch.empty((M, B, T, r), dtype=out_dtype, device=z.device)
            if gate is None:
                torch.addcmul(self.static_codes, dynamic, scale, out=out.permute(1, 2, 0, 3))
            else:
                g = gate.unsqueeze(-1)
                torch.addcmul(dynamic.mul_(g * scale), g, self.static_codes, out=out.permute(1, 2, 0, 3))
        gate_seen = None if gate is None else gate.detach()
        codes_seen = out.detach().permute(1, 2, 0, 3)
        if self.training and torch.is_grad_enabled():
            # training passes keep only what is alive anyway (the codes every block reads) and the
            # small gate; the per-level tensors would only cost memory
            levels = {"prefix": None, "chunk": None, "dynamic": None, "token": None, "gate": gate_seen,
                      "codes": codes_seen}
        else:
            levels = RoutingLevels(self, z.detach(), p.detach(), chunk_ctx.detach(), gate_seen, codes_seen)
        return out, levels

    # ------------------------------------------------------------------ whole sequences
    def forward(
        self,
        hidden: torch.Tensor,
        attention_mask: Optional[torch.Tensor] = None,
        side_signals: Optional[torch.Tensor] = None,
        out_dtype: Optional[torch.dtype] = None,
        return_state: bool = False,
    ) -> RoutingOutput:
        """Codes for whole sequences starting at position 0. hidden: (B, T, H), mask: (B, T)."""
        B, T, _ = hidden.shape
        out_dtype = out_dtype or hidden.dtype
        self._check_mask(attention_mask, B, T)
        self.check_side(side_signals, B)
        outputs = None
        if self.graphs.forward_eligible(hidden):
            outputs = self.graphs.run_forward(hidden, attention_mask, side_signals, out_dtype, return_state)
        if outputs is None:
            outputs = self.forward_math(hidden, attention_mask, side_signals, out_dtype, return_state)
        codes, levels, state_tensors = outputs
        state = None
        if state_tensors is not None:
            count, prefix_sum, chunk_ema, open_sum, side = state_tensors
            state = RoutingState(count=count, prefix_sum=prefix_sum, chunk_ema=chunk_ema, open_sum=open_sum,
                                 side=side)
        return RoutingOutput(codes=codes, state=state, levels=levels)

    def forward_math(self, hidden: torch.Tensor, attention_mask: Optional[torch.Tensor],
                     side_signals: Optional[torch.Tensor], out_dtype: torch.dtype, return_state: bool) -> tuple:
        """`forward` as pure tensor work on checked inputs (no host syncs), so a CUDA graph can replay it:
        (codes, levels, (count, prefix_sum, chunk_ema, open_sum, side) or None)."""
        B, T, _ = hidden.shape
        z = self.project(hidden)
        mask = self._mask(attention_mask, B, T, z.dtype, z.device)
        C, P = self.chunk_size, self.max_prefix_tokens
        seen = mask.cumsum(1)  # real tokens up to and including t
        pos = (seen - 1).clamp(min=0).long()  # position from the first real token

        in_prefix = mask * (seen <= P)
        # the running sum along the tokens as a scan over the innermost dim of a (B, d, T) copy: torch's scan
        # along an outer dim runs one thread per (row, channel) over all T (0.18 ms of a 0.5 ms call at 8x1024)
        prefix_sum = (z * in_prefix.unsqueeze(-1)).transpose(1, 2).cumsum(-1).transpose(1, 2)
        p = prefix_sum / seen.clamp(1, P).unsqueeze(-1)  # the prefix holds the first min(seen, P) real tokens

        # chunk sums over real tokens; padding goes to an extra slot that is dropped
        num_chunks = T // C + 1
        chunk_index = torch.where(mask > 0, pos // C, torch.full_like(pos, num_chunks))
        index_d = chunk_index.unsqueeze(-1).expand_as(z)
        chunk_sum = z.new_zeros(B, num_chunks + 1, z.shape[-1]).scatter_add(1, index_d, z * mask.unsqueeze(-1))
        chunk_count = mask.new_zeros(B, num_chunks + 1).scatter_add(1, chunk_index, mask)
        chunk_mean = chunk_sum / chunk_count.clamp(min=1).unsqueeze(-1)
        # p at the last token of each chunk (only complete chunks are ever read)
        is_last = mask * (pos % C == C - 1).to(mask.dtype)
        chunk_end_p = z.new_zeros(B, num_chunks + 1, z.shape[-1]).scatter_add(1, index_d, p * is_last.unsqueeze(-1))
        summaries = self.chunk_summary(torch.cat([chunk_mean, chunk_end_p], dim=-1))[:, :num_chunks]
        ema = self._ema_over_chunks(summaries)  # (B, num_chunks, d): e_k for k = 0..num_chunks-1

        side = self.project_side(side_signals)
        chunk_ctx_per_chunk = ema if side is None else ema + side.unsqueeze(1)
        chunk_ctx = torch.gather(chunk_ctx_per_chunk, 1, chunk_index.clamp(max=num_chunks - 1).unsqueeze(-1)
                                 .expand(B, T, z.shape[-1]))
        codes, levels = self._codes(z, p, chunk_ctx, out_dtype)
        if not return_state:
            return codes, levels, None
        count = mask.sum(1).long()
        open_chunk = (count // C).clamp(max=num_chunks - 1)
        rows = torch.arange(B, device=z.device)
        # standard strides (also for one row): a compiled decode step guards on the strides of the state it reads
        state = (count, prefix_sum[:, -1].clone(memory_format=torch.contiguous_format), ema[rows, open_chunk], chunk_sum[rows, open_chunk], side)
        return codes, levels, state

    def _ema_over_chunks(self, summaries: torch.Tensor) -> torch.Tensor:
        """e_k = Σ_{j<k} (1-β) β^{k-1-j} f_j as one small matrix product over chunks."""
        return torch.einsum("kj,bjd->bkd", self._ema_weights(summaries.shape[1], summaries), summaries)

    def _ema_weights(self, n: int, like: torch.Tensor) -> torch.Tensor:
        """The (n, n) matrix of the chunk EMA, made once per size, dtype and device (eight kernels less
        per call) except while compiling, where it is part of the graph."""
        key = (n, like.dtype, like.device, self.ema_decay)
        compiling = torch.compiler.is_compiling()
        weights = None if compiling else self._ema_weights_made.get(key)
        if weights is None:
            with torch.inference_mode(False), torch.no_grad():  # a constant usable in any later pass
                beta = self.ema_decay
                k = torch.arange(n, device=like.device, dtype=like.dtype)
                exponent = k.unsqueeze(1) - 1 - k.unsqueeze(0)  # k-1-j
                weights = torch.where(exponent >= 0, (1 - beta) * beta ** exponent.clamp(min=0),
                                      torch.zeros_like(exponent))
            if not compiling:
                if len(self._ema_weights_made) >= 32:
                    self._ema_weights_made.clear()
                self._ema_weights_made[key] = weights
        return weights

    @staticmethod
    def _check_mask(attention_mask: Optional[torch.Tensor], B: int, T: int) -> None:
        if attention_mask is not None and attention_mask.shape != (B, T):
            raise ValueError(
                f"attention_mask for the new tokens must have shape ({B}, {T}), got {tuple(attention_mask.shape)}"
            )

    @staticmethod
    def _mask(attention_mask: Optional[torch.Tensor], B: int, T: int, dtype: torch.dtype,
              device: torch.device) -> torch.Tensor:
        """The mask as 0/1 values of dtype (after _check_mask)."""
        if attention_mask is None:
            return torch.ones(B, T, dtype=dtype, device=device)
        return (attention_mask != 0).to(dtype)

    # ------------------------------------------------------------------ incremental (cached) decoding
    def step(
        self,
        hidden: torch.Tensor,
        state: RoutingState,
        attention_mask: Optional[torch.Tensor] = None,
        out_dtype: Optional[torch.dtype] = None,
    ) -> RoutingOutput:
        """Codes for T new tokens that follow `state`, token by token; returns the advanced state."""
        B, T, _ = hidden.shape
        if state.batch_size != B:
            raise ValueError(f"routing state holds {state.batch_size} sequences but the input has {B}")
        out_dtype = out_dtype or hidden.dtype
        self._check_mask(attention_mask, B, T)
        mask = self._mask(attention_mask, B, T, self.input_proj.weight.dtype, hidden.device)
        tensors = (state.count, state.prefix_sum, state.chunk_ema, state.open_sum, state.side)
        if self.graphs.step_eligible(hidden):
            codes, levels, *advanced = self.graphs.run_step(hidden, mask, tensors, out_dtype)
        else:
            codes, levels, *advanced = self.step_math(hidden, mask, *tensors, out_dtype=out_dtype)
        count, prefix_sum, chunk_ema, open_sum = advanced
        new_state = RoutingState(count=count, prefix_sum=prefix_sum, chunk_ema=chunk_ema, open_sum=open_sum,
                                 side=state.side)
        return RoutingOutput(codes=codes, state=new_state, levels=levels)

    def step_math(self, hidden, mask, count, prefix_sum, chunk_ema, open_sum, side, out_dtype):
        """The recurrence of `step` as pure tensor work (no host syncs), so a CUDA graph can replay it."""
        z = self.project(hidden)
        C, P, beta = self.chunk_size, self.max_prefix_tokens, self.ema_decay
        all_p, all_ctx = [], []
        for t in range(hidden.shape[1]):
            real = mask[:, t]
            z_t = z[:, t]
            in_prefix = real * (count < P).to(real.dtype)
            prefix_sum = prefix_sum + z_t * in_prefix.unsqueeze(-1)
            prefix_count = torch.clamp(count + in_prefix.long(), max=P).to(z.dtype)
            p_t = prefix_sum / prefix_count.clamp(min=1).unsqueeze(-1)
            all_p.append(p_t)
            all_ctx.append(chunk_ema if side is None else chunk_ema + side)
            # advance: add the token to the open chunk; close the chunk when it is full. The summary is
            # computed for every row and kept where a chunk closed: no host sync.
            open_sum = open_sum + z_t * real.unsqueeze(-1)
            count = count + real.long()
            closes = ((real > 0) & (count % C == 0)).unsqueeze(-1)
            summary = self.chunk_summary(torch.cat([open_sum / C, p_t], dim=-1))
            chunk_ema = torch.where(closes, beta * chunk_ema + (1 - beta) * summary, chunk_ema)
            open_sum = torch.where(closes, torch.zeros_like(open_sum), open_sum)
        p = torch.stack(all_p, dim=1)
        chunk_ctx = torch.stack(all_ctx, dim=1)
        codes, levels = self._codes(z, p, chunk_ctx, out_dtype)
        return codes, levels, count, prefix_sum, chunk_ema, open_sum
