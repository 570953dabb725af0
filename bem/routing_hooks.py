"""Hooks that feed the controller without editing model code.

- A pre-hook on the whole model records what this call is: the attention mask of the new tokens,
  whether it continues a KV cache (and the routing state stored with that cache), side signals.
- A pre-hook on the first block captures the hidden states entering it (the embedding output) and
  runs the controller once per call, writing the codes into the shared `RoutingContext`.
- A post-hook on the whole model stores the advanced routing state on the returned cache object
  (`cache_state`), so the state follows the cache through `generate`, beam-search reordering included.
"""

from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass
from typing import Any, Optional

import torch
import torch.nn as nn

from .modules.bem_linear import RoutingContext
from . import cache_state
from .modules.controller import HierarchicalController, RoutingState

def _keep(tensor: torch.Tensor) -> torch.Tensor:
    return tensor


@dataclass
class CallInfo:
    attention_mask: Optional[torch.Tensor]  # (B, T_new) or None
    state: Optional[RoutingState]  # the state this call continues, or None for a new sequence
    want_state: bool
    side_signals: Optional[torch.Tensor]
    codes_ready: bool = False
    new_state: Optional[RoutingState] = None


def _cache_length(cache: Any) -> Optional[int]:
    """Positions held by a cache, when that can be read without a device sync; None otherwise."""
    if cache is None:
        return 0
    if getattr(cache, "is_compileable", False):
        return None  # static caches count filled slots on the device
    if hasattr(cache, "get_seq_length"):
        return int(cache.get_seq_length())
    if isinstance(cache, (tuple, list)) and cache and cache[0] is not None:
        return int(cache[0][0].shape[-2])  # legacy tuple-of-tuples cache
    return 0


class RoutingHooks:
    """Installs and owns the hooks for one wrapped model."""

    def __init__(self, model: nn.Module, first_block: nn.Module, controller: Optional[HierarchicalController],
                 context: RoutingContext) -> None:
        self.model = model
        self.controller = controller
        self.context = context
        self.call: Optional[CallInfo] = None
        self.pending_side_signals: Optional[torch.Tensor] = None
        self.last_levels: Optional[dict] = None
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
        if self.controller is None or not self.context.enabled:
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
        cache = arguments.get("past_key_values")
        state = cache_state.get_state(cache)
        past_length = _cache_length(cache)
        mask = arguments.get("attention_mask")
        if mask is not None:
            if mask.dim() != 2:
                raise ValueError(
                    f"BEM needs a 2-D attention_mask (batch, sequence); got shape {tuple(mask.shape)}"
                )
            if mask.shape[0] != batch or mask.shape[1] < new_tokens:
                raise ValueError(
                    f"attention_mask of shape {tuple(mask.shape)} does not cover input of shape ({batch}, {new_tokens})"
                )
            mask = mask[:, -new_tokens:]
        if state is None and past_length:
            raise ValueError(
                "this call continues a KV cache that carries no BEM routing state (the cache was built "
                "without BEM, was cropped, or was copied); run the full sequence instead"
            )
        if state is not None and past_length == 0:
            state = None  # an emptied cache starts a new sequence
        if state is not None and (state.batch_size != batch or past_length not in (None, state.seen_tokens)):
            raise ValueError(
                f"the BEM routing state covers {state.batch_size} sequences of {state.seen_tokens} positions "
                f"but the cache holds {past_length} positions for {batch} sequences"
            )
        use_cache = arguments.get("use_cache")
        config_use_cache = getattr(getattr(module, "config", None), "use_cache", False)
        want_state = bool(use_cache if use_cache is not None else config_use_cache)
        side = self.pending_side_signals
        self.call = CallInfo(mask, state, want_state, side)
        return None

    def _before_first_block(self, module: nn.Module, args: tuple, kwargs: dict):
        call = self.call
        if call is None or not self.context.enabled:
            return None
        if call.codes_ready:
            return None  # re-entered (e.g. activation recompute): the codes of this call stand
        hidden = args[0] if args else kwargs.get("hidden_states")
        if hidden is None or hidden.dim() != 3:
            raise ValueError("BEM could not read the hidden states entering the first block")
        dtype = next((p.dtype for p in module.parameters() if p.is_floating_point()), hidden.dtype)
        # Some transformers versions run block hooks inside an activation-checkpointed region. The
        # controller runs once per call, so its saved tensors must stay out of that region's
        # drop-and-recompute bookkeeping: keep them as they are.
        keep_saved = torch.is_grad_enabled() and not torch.compiler.is_compiling()
        with torch.autograd.graph.saved_tensors_hooks(_keep, _keep) if keep_saved else contextlib.nullcontext():
            if call.state is None:
                out = self.controller(hidden, call.attention_mask, call.side_signals, out_dtype=dtype,
                                      return_state=call.want_state)
            else:
                out = self.controller.step(hidden, call.state, call.attention_mask, out_dtype=dtype)
        self.context.set_codes(out.codes)
        self.last_levels = out.levels
        call.new_state = out.state
        call.codes_ready = True
        return None

    def _after_model(self, module: nn.Module, args: tuple, kwargs: dict, output: Any):
        call, self.call = self.call, None
        if call is None or call.new_state is None:
            return None
        cache = getattr(output, "past_key_values", None)
        if cache is None and isinstance(output, tuple) and len(output) > 1:
            cache = output[1]
        if cache is not None and not isinstance(cache, (tuple, list, torch.Tensor)):
            previous = call.state
            if previous is not None and torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
                # inside a CUDA-graph capture: advance the state in place, so that every replay reads
                # the state the previous replay wrote (the graph's inputs are fixed addresses)
                previous.copy_from(call.new_state)
            else:
                cache_state.set_state(cache, call.new_state)
        return None
