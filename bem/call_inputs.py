"""The one place that reads what a call into a transformers model carries, whatever the installed release
calls it: the cache object, the number of positions already in it, and the 2-D padding mask of the new tokens.

- The cache is passed as `cache` (transformers 5.24 on), `past_key_values` (up to 5.23) or `cache_params`
  (state-space models); outputs return it under the same names.
- The mask is 2-D (batch, positions) when the user passes it, but under a static cache transformers turns it into
  a 4-D mask, or a dict of masks per layer type, before the forward. `BEMModel.generate` captures the 2-D mask
  before that happens (`capture_generate_masks`); elsewhere the rows' padding is derived from `position_ids`
  (left padding), and a mask BEM cannot read is refused.
- The past length is a Python int on dynamic caches, but a live 0-d tensor on static ones: reading it costs a
  device sync and cannot be done under `torch.compile`, so it is read only where it decides something.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

CACHE_NAMES = ("cache", "past_key_values", "cache_params")


def _installed_cache_keyword() -> str:
    from transformers.modeling_outputs import BaseModelOutputWithPast

    fields = getattr(BaseModelOutputWithPast, "__dataclass_fields__", {})
    return "cache" if "cache" in fields else "past_key_values"


# What the installed transformers calls the cache keyword of decoder models' forward and outputs.
CACHE_KEYWORD = _installed_cache_keyword()


def cache_keyword(model: nn.Module) -> str:
    """The cache keyword `model.forward` takes (the installed release's own name where it names none)."""
    try:
        import inspect

        parameters = inspect.signature(model.forward).parameters
    except (TypeError, ValueError):
        return CACHE_KEYWORD
    return next((name for name in CACHE_NAMES if name in parameters), CACHE_KEYWORD)


def returned_cache(output: Any) -> Any:
    """The cache a model output returns, read by its field name (the deprecated aliases warn)."""
    if isinstance(output, tuple):
        return output[1] if len(output) > 1 and not isinstance(output[1], torch.Tensor) else None
    fields = getattr(type(output), "__dataclass_fields__", None)
    if fields is None:
        return None
    for name in CACHE_NAMES:
        if name in fields:
            return output.get(name) if hasattr(output, "get") else getattr(output, name, None)
    return None


def the_cache(arguments: dict) -> Any:
    """The cache a call passes, under whichever name; None for none. Two different caches, or an object that is
    not a transformers `Cache`, are refused."""
    found = [(name, arguments[name]) for name in CACHE_NAMES if arguments.get(name) is not None]
    # compared only when several names are given: an identity test under torch.compile guards on the object,
    # and generate's static caches are new objects from call to call
    if len(found) > 1 and any(cache is not found[0][1] for _, cache in found[1:]):
        names = ", ".join(f"{name} ({type(cache).__name__})" for name, cache in found)
        raise ValueError(f"this call passes two different caches, under {names}; pass one")
    if not found:
        return None
    name, cache = found[0]
    from transformers.cache_utils import Cache

    if not isinstance(cache, Cache):
        raise ValueError(
            f"BEM does not know a cache of type {type(cache).__name__} (passed as {name}); it follows transformers' "
            f"Cache classes (DynamicCache, StaticCache, ...)"
        )
    return cache


def cached_positions(cache: Any, allow_sync: bool) -> Optional[int]:
    """Positions a cache holds: an int, or None where that needs a device sync that is not allowed (or that
    `torch.compile` is tracing)."""
    if cache is None:
        return 0
    length = cache.get_seq_length()
    if isinstance(length, torch.Tensor):
        if not allow_sync or torch.compiler.is_compiling():
            return None
        return int(length)
    return None if torch.compiler.is_compiling() and not isinstance(length, int) else int(length)


def _padding_from_positions(position_ids: Optional[torch.Tensor], batch: int, new_tokens: int,
                            mask_form: str) -> torch.Tensor:
    """Left padding as transformers' generate numbers it: pads first, then positions 0, 1, ... So a row's
    real tokens are its last `position_ids[:, -1] + 1`."""
    if position_ids is None or position_ids.dim() != 2 or tuple(position_ids.shape) != (batch, new_tokens):
        raise ValueError(
            f"BEM needs the 2-D padding mask (batch, sequence) of each call, but got {mask_form} and no "
            f"position_ids of shape ({batch}, {new_tokens}) to derive it from; pass the 2-D attention_mask "
            f"(transformers builds the larger masks from it), or call generate through the BEMModel"
        )
    real_count = position_ids[:, -1:] + 1
    index = torch.arange(new_tokens, device=position_ids.device)
    return (index >= new_tokens - real_count).to(torch.long)


def _mask_form(mask: Any) -> str:
    if isinstance(mask, torch.Tensor):
        return f"a {mask.dim()}-D attention mask of shape {tuple(mask.shape)}"
    if isinstance(mask, dict):
        return f"a dict of attention masks per layer type ({', '.join(map(str, mask))})"
    return f"an attention mask of type {type(mask).__name__}"


def padding_mask(arguments: dict, batch: int, new_tokens: int, captured: Optional[torch.Tensor] = None,
                 continues: bool = False) -> Optional[torch.Tensor]:
    """The (batch, new tokens) mask of a call's new tokens, nonzero where a token is real; None: all real.
    `captured` is the 2-D mask generate held before turning it into a larger one; `continues` says the call
    continues a sequence BEM carries state for (decode steps append real tokens)."""
    mask = arguments.get("attention_mask")
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor) and mask.dim() == 2:
        if mask.shape[0] != batch or mask.shape[1] < new_tokens:
            raise ValueError(
                f"attention_mask of shape {tuple(mask.shape)} does not cover input of shape ({batch}, {new_tokens})"
            )
        return mask[:, -new_tokens:]
    if not isinstance(mask, (torch.Tensor, dict)) and type(mask).__name__ != "BlockMask":
        raise ValueError(f"BEM does not know {_mask_form(mask)}; pass the 2-D attention_mask (batch, sequence)")
    if captured is not None and tuple(captured.shape) == (batch, new_tokens):
        return captured
    if continues:
        return None
    return _padding_from_positions(arguments.get("position_ids"), batch, new_tokens, _mask_form(mask))


@contextlib.contextmanager
def capture_generate_masks(model: nn.Module, keep: "MaskSlot") -> Iterator[None]:
    """Inside the block, `model.prepare_inputs_for_generation` leaves the 2-D mask of each step's new tokens in
    `keep` before transformers turns it into a 4-D mask or a dict (static caches, compiled decoding)."""
    original = model.__dict__.get("prepare_inputs_for_generation")
    bound = model.prepare_inputs_for_generation

    @functools.wraps(bound)
    def prepare(*args: Any, **kwargs: Any) -> dict:
        inputs = bound(*args, **kwargs)
        mask, passed = kwargs.get("attention_mask"), inputs.get("attention_mask")
        tokens = inputs.get("input_ids") if inputs.get("input_ids") is not None else inputs.get("inputs_embeds")
        converted = not (isinstance(passed, torch.Tensor) and passed.dim() == 2)
        if converted and isinstance(mask, torch.Tensor) and mask.dim() == 2 and tokens is not None:
            keep.hold(mask[:, -tokens.shape[1]:])
        else:
            keep.mask = None
        return inputs

    model.prepare_inputs_for_generation = prepare
    try:
        yield
    finally:
        keep.mask = None
        if original is None:
            del model.prepare_inputs_for_generation
        else:
            model.prepare_inputs_for_generation = original


class MaskSlot:
    """Holds the 2-D mask of the next call's new tokens, captured in generate; read once.

    The mask is copied into a buffer kept per shape, dtype and device, so that each decoding step finds it at the
    same address. A compiled step reaches the slot through the model's hooks, so torch.compile takes the mask
    as a static input, whose address inductor's CUDA graphs bake in: a new tensor each step would re-record
    them every step."""

    _KEPT_SHAPES = 4  # prefill and decoding shapes of the last few generates; the oldest buffer goes first

    def __init__(self) -> None:
        self.mask: Optional[torch.Tensor] = None
        self._buffers: dict[tuple, torch.Tensor] = {}

    def hold(self, mask: torch.Tensor) -> None:
        key = (tuple(mask.shape), mask.dtype, mask.device)
        buffer = self._buffers.pop(key, None)
        if buffer is None:
            while len(self._buffers) >= self._KEPT_SHAPES:
                self._buffers.pop(next(iter(self._buffers)))
            # standard strides (a one-row view counts as contiguous but keeps its growing row stride): a
            # compiled step guards on its inputs' strides
            buffer = torch.empty(mask.shape, dtype=mask.dtype, device=mask.device)
        self._buffers[key] = buffer  # most recently used last
        self.mask = buffer.copy_(mask)

    def take(self) -> Optional[torch.Tensor]:
        mask, self.mask = self.mask, None
        return mask
