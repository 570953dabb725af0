"""Hooks that follow each call of the wrapped model without editing model code.

- A pre-hook on the backbone reads what the call is (`call_inputs`): the padding mask of the new tokens,
  whether it continues a KV cache (and the state BEM stored on that cache), side signals. A call that
  continues a cache without BEM's state is refused.
- A pre-hook on the first block captures the hidden states entering it (the embedding output) and runs the
  controller once per call, writing the codes into the shared `RoutingContext`.
- Blocks that keep a decode state of their own (the sequence mixers) read their part of the state from the
  current call and leave their advanced part in it (`CallState.previous_part` / `set_part`).
- A post-hook on the backbone stores the advanced parts on the returned cache object (`cache_state`), so
  they follow the cache through `generate`, beam-search reordering included.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass, field
from typing import Any, Optional

import torch
import torch.nn as nn

from . import cache_state, call_inputs
from .cache_state import CacheState, CarriedState, PinnedStates
from .modules.bem_linear import RoutingContext
from .modules.controller import HierarchicalController

ROUTING = "routing"


def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


def _codes_dtype(first_block: nn.Module, hidden: torch.Tensor) -> torch.dtype:
    """The dtype the wrapped linears compute in, which the codes are made in: autocast's where it is on (the
    linears compute in it, and codes of another dtype would be cast once per linear, and each cast kept for the
    backward), else the first block's."""
    if torch.is_autocast_enabled(hidden.device.type):
        return torch.get_autocast_dtype(hidden.device.type)
    return next((p.dtype for p in first_block.parameters() if p.is_floating_point()), hidden.dtype)


@dataclass
class CallState:
    """What one call of the backbone carries in and out."""

    padding_mask: Optional[torch.Tensor]  # (B, T_new), nonzero where real; None: all real
    previous: Optional[CacheState]  # the state this call continues, or None for a new sequence
    want_state: bool  # the call returns a cache: leave the advanced state on it
    side_signals: Optional[torch.Tensor]
    new_tokens: int
    cache_capacity: Optional[int] = None  # positions a static cache holds; None for a growing cache
    codes_ready: bool = False
    new_parts: dict[str, CarriedState] = field(default_factory=dict)

    def previous_part(self, name: str) -> Optional[CarriedState]:
        return None if self.previous is None else self.previous.parts.get(name)

    def set_part(self, name: str, part: Optional[CarriedState]) -> None:
        if part is not None and self.want_state:
            self.new_parts[name] = part


class CallHooks:
    """Installs and owns the hooks for one wrapped model."""

    def __init__(self, model: nn.Module, first_block: nn.Module, controller: Optional[HierarchicalController],
                 context: RoutingContext, stateful_blocks: int = 0) -> None:
        self.model = model
        self.controller = controller
        self.context = context
        self.stateful_blocks = stateful_blocks  # blocks besides the controller that keep a decode state
        self.call: Optional[CallState] = None
        self.pending_side_signals: Optional[torch.Tensor] = None
        self.side_signals_follow_expansion = False  # inside generate: a row's copies share its side signal
        self.generate_masks = call_inputs.MaskSlot()
        self.last_levels: Optional[dict] = None
        self.pinned_states = PinnedStates()
        self._positional_names = [
            name for name, parameter in inspect.signature(model.forward).parameters.items()
            if parameter.kind in (parameter.POSITIONAL_ONLY, parameter.POSITIONAL_OR_KEYWORD)
        ]
        cache_state.install()
        self._handles = [
            model.register_forward_pre_hook(self._before_model, with_kwargs=True),
            first_block.register_forward_pre_hook(self._before_first_block, with_kwargs=True),
            model.register_forward_hook(self._after_model, with_kwargs=True),
        ]

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles = []

    # ------------------------------------------------------------------ hooks
    def _bound_arguments(self, args: tuple, kwargs: dict) -> dict:
        arguments = dict(zip(self._positional_names, args))
        arguments.update(kwargs)
        return arguments

    def _before_model(self, module: nn.Module, args: tuple, kwargs: dict):
        captured = self.generate_masks.take()
        pack = self.context.pack
        if pack is not None and torch.compiler.is_compiling() and not torch.is_grad_enabled():
            self.context.weights = pack.weights()  # one compiled input for every module's V and U
        if (self.controller is None and not self.stateful_blocks) or not self.context.enabled:
            self.call = None
            return None
        arguments = self._bound_arguments(args, kwargs)
        input_ids, embeds = arguments.get("input_ids"), arguments.get("inputs_embeds")
        tokens = input_ids if input_ids is not None else embeds
        if tokens is None:
            raise ValueError("BEM needs input_ids or inputs_embeds to route")
        if input_ids is not None and input_ids.dim() != 2:
            raise ValueError(f"input_ids must have shape (batch, sequence), got {tuple(input_ids.shape)}")
        batch, new_tokens = tokens.shape[0], tokens.shape[1]
        cache = call_inputs.the_cache(arguments)
        state = cache_state.get_state(cache)
        if state is not None and state.empty:
            state = None  # a reset static cache: its state's tensors wait to be reused
        if state is None:
            past = call_inputs.cached_positions(cache, allow_sync=True)
            if past:
                raise ValueError(
                    f"this call continues a KV cache of {past} positions that carries no BEM state (the cache was "
                    f"built without BEM, was cropped, or was copied); run the full sequence instead"
                )
        else:
            past = call_inputs.cached_positions(cache, allow_sync=False)
            if past == 0:
                state = None  # an emptied cache starts a new sequence
            elif state.batch_size not in (None, batch) or (
                    past is not None and state.seen_tokens is not None and past != state.seen_tokens):
                raise ValueError(
                    f"the BEM state on this cache covers {state.batch_size} sequences of {state.seen_tokens} "
                    f"positions but the cache holds {past} positions and the call brings {batch} sequences"
                )
        mask = call_inputs.padding_mask(arguments, batch, new_tokens, captured, continues=state is not None)
        use_cache = arguments.get("use_cache")
        config_use_cache = getattr(getattr(module, "config", None), "use_cache", False)
        want_state = bool(use_cache if use_cache is not None else config_use_cache)
        capacity = cache.get_max_length() if getattr(cache, "is_compileable", False) else None
        self.call = CallState(mask, state, want_state, self.pending_side_signals, new_tokens,
                              capacity if isinstance(capacity, int) and capacity > 0 else None)
        return None

    def _side_signals(self, side: Optional[torch.Tensor], batch: int) -> Optional[torch.Tensor]:
        """The side signals of a call's `batch` rows. generate repeats each row of its input (by
        max(num_beams, num_return_sequences) in current transformers, or as a GenerationConfig says); each
        copy takes its row's signal. A count that fits no such repeat is left for the controller to refuse."""
        if (side is None or not self.side_signals_follow_expansion or side.dim() != 2 or side.shape[0] == 0
                or batch == side.shape[0] or batch % side.shape[0]):
            return side
        return side.repeat_interleave(batch // side.shape[0], 0)

    def _before_first_block(self, module: nn.Module, args: tuple, kwargs: dict):
        call = self.call
        if call is None or self.controller is None or not self.context.enabled:
            return None
        if call.codes_ready:
            return None  # re-entered (e.g. activation recompute): the codes of this call stand
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None or hidden.dim() != 3:
            raise ValueError("BEM could not read the hidden states entering the first block")
        dtype = _codes_dtype(module, hidden)
        routing = call.previous_part(ROUTING)
        # Some transformers versions run block hooks inside an activation-checkpointed region. The
        # controller runs once per call, so its saved tensors must stay out of that region's
        # drop-and-recompute bookkeeping: keep them as they are.
        keep_saved = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep) if keep_saved else contextlib.nullcontext():
            if routing is None:
                side = self._side_signals(call.side_signals, hidden.shape[0])  # read at a sequence's start only
                out = self.controller(hidden, call.padding_mask, side, out_dtype=dtype,
                                      return_state=call.want_state)
            else:
                out = self.controller.step(hidden, routing, call.padding_mask, out_dtype=dtype)
        self.context.set_codes(out.codes)
        if not torch.compiler.is_compiling():
            # kept for routing_stats(); a compiled call would have to return them, and tensors it returns that
            # live on past the call hold on to its CUDA graphs' memory
            self.last_levels = out.levels
        call.set_part(ROUTING, out.state)
        call.codes_ready = True
        return None

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        call, self.call = self.call, None
        self.context.weights = None  # views the compiled call made: not returned from it
        if call is not None and not torch.is_grad_enabled():
            # the codes served this call only; a backward's recompute (activation checkpointing) would need
            # them, but no backward follows an inference call
            self.context.codes = None
        if call is None or not call.new_parts:
            return None
        cache = call_inputs.returned_cache(output)
        if cache is None or isinstance(cache, (tuple, list, torch.Tensor)):
            return None
        in_place = bool(getattr(cache, "is_compileable", False))  # a static cache: fixed addresses
        previous = call.previous
        if in_place or torch.compiler.is_compiling() or (previous is not None and previous.seen_tokens is None):
            seen = None  # where a Python count would not follow CUDA-graph replays, or would be a compile guard
        else:
            seen = (0 if previous is None else previous.seen_tokens) + call.new_tokens
        kept = cache_state.get_state(cache)
        # in place only into tensors made outside torch.compile: ones a compiled call returned belong to its
        # CUDA graphs' memory (a static cache's first call should run eagerly, as transformers' generate does)
        if in_place and kept is not None and kept.pinned and kept.can_take(call.new_parts):
            kept.take(call.new_parts, seen)
            return None
        pinnable = in_place and not torch.compiler.is_compiling()
        state = self.pinned_states.claim(cache, call.new_parts, seen) if pinnable else None
        if state is None:
            state = CacheState(call.new_parts, seen, in_place=in_place)
            if pinnable:
                state.pin()
                self.pinned_states.add(cache, state)
        cache_state.set_state(cache, state)
        return None
