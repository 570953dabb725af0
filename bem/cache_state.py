"""State that rides on the KV cache object, so it follows the cache wherever `generate` takes it.

What BEM keeps between calls of one sequence (the routing state, each sequence mixer's decode state) is a set
of named parts, each implementing the small `CarriedState` protocol. They travel together as one `CacheState`
stored on the cache. `Cache` methods that reorder, select, repeat, crop or reset rows are wrapped once (at
import of this module's `install`) so that a cache carrying a state transforms every part the same way:
beam search, static caches and CUDA-graph capture treat the routing state and the mixers' states alike.
Caches without a state behave exactly as before. Wrapping the classes, not each cache instance, keeps the
model's forward free of method patching, which `torch.compile` cannot trace.

No part can be rewound, so a cache that carries a state reports `is_croppable = False` (transformers then
refuses assisted decoding cleanly), and `crop` (under either of transformers' conventions) drops the state:
a later call that continues the cropped cache is refused instead of routed with stale state.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass, field
from typing import Any, Callable, Optional, Protocol, runtime_checkable

import torch

STATE_ATTR = "_bem_cache_state"
_WRAPPED_FLAG = "_bem_wraps_cache_state"


@runtime_checkable
class CarriedState(Protocol):
    """Per-row state of a sequence that rides on the cache; every tensor's first dimension is the batch."""

    def tensors(self) -> list[torch.Tensor]:
        """Every tensor of the state (to check shapes and to pin addresses)."""

    def index_select(self, index: torch.Tensor) -> "CarriedState":
        """Rows reordered or selected (beam search), as a new state."""

    def repeat_interleave(self, repeats: int) -> "CarriedState":
        """Each row repeated (expanding a prompt to beams or samples), as a new state."""

    def copy_from(self, other: "CarriedState") -> None:
        """Overwrite this state's tensors with another's, in place (CUDA-graph replays read fixed addresses)."""


def _layout(part: CarriedState) -> list[tuple]:
    return [(tuple(t.shape), t.dtype, t.device) for t in part.tensors()]


@dataclass
class CacheState:
    """Every part BEM carries on one cache: "routing" and "mixer.<block>" by name.

    On a static cache (`in_place`), the parts keep their tensors for the cache's life: each call advances them
    in place, beam search reorders them in place, and a reset marks them `empty` rather than dropping them. So
    a compiled decoding step, and the CUDA graphs it replays, always read and write the same addresses, as
    they do the static cache's keys and values. On other caches each call leaves a new state.

    `seen_tokens` counts the positions processed, padding included, so that a cache changed behind BEM's back
    is caught; None where it cannot follow (an in-place state, or one advanced inside `torch.compile`, where a
    Python int would be a guard that recompiles every step), and then it is not checked."""

    parts: dict[str, CarriedState] = field(default_factory=dict)
    seen_tokens: Optional[int] = 0
    in_place: bool = False
    empty: bool = False
    pinned: bool = False  # its tensors were made outside torch.compile and marked as fixed addresses

    @property
    def batch_size(self) -> Optional[int]:
        for part in self.parts.values():
            tensors = part.tensors()
            if tensors:
                return tensors[0].shape[0]
        return None

    def can_take(self, parts: dict[str, CarriedState]) -> bool:
        """Whether `parts` have this state's names and tensor layouts (so they can be copied in)."""
        return set(parts) == set(self.parts) and all(_layout(parts[n]) == _layout(p) for n, p in self.parts.items())

    def take(self, parts: dict[str, CarriedState], seen_tokens: Optional[int]) -> None:
        """Copy `parts` into this state's tensors (after `can_take`)."""
        for name, part in self.parts.items():
            part.copy_from(parts[name])
        self.seen_tokens, self.empty = seen_tokens, False

    def pin(self) -> None:
        """Tell torch.compile that these tensors keep their addresses (as transformers does for a static
        cache's keys and values), so that compiled steps may update them in place inside CUDA graphs."""
        for part in self.parts.values():
            for tensor in part.tensors():
                torch._dynamo.mark_static_address(tensor, guard=False)
        self.pinned = True

    def index_select(self, index: torch.Tensor) -> "CacheState":
        selected = {name: part.index_select(index) for name, part in self.parts.items()}
        if self.in_place and self.can_take(selected):
            self.take(selected, self.seen_tokens)
            return self
        return CacheState(selected, self.seen_tokens, self.in_place, self.empty)

    def repeat_interleave(self, repeats: int) -> "CacheState":
        return CacheState({name: part.repeat_interleave(repeats) for name, part in self.parts.items()},
                          self.seen_tokens, self.in_place, self.empty)

    def copy_from(self, other: "CacheState") -> None:
        if not self.can_take(other.parts):
            raise ValueError(f"cannot copy BEM cache state with parts {sorted(other.parts)} into {sorted(self.parts)}")
        self.take(other.parts, other.seen_tokens)

    def reset(self) -> Optional["CacheState"]:
        """The state after the cache is reset: kept (marked empty) where it is updated in place, else dropped."""
        if self.in_place:
            self.empty = True
            return self
        return None


class PinnedStates:
    """The pinned states of one model's static caches, kept for the next static cache to reuse.

    `generate` makes a new static cache each call. If each one's BEM state were new tensors, their addresses
    would differ from call to call, and the CUDA graphs of the compiled decoding step, which read the state at
    the addresses they were recorded with, would be recorded again. A state is reused only once the cache it
    belonged to is gone or no longer carries it, so two static caches alive at once never share tensors."""

    # Two: a caller that keeps the previous generate's output holds its cache while the next one starts, so
    # two states alternate. A mixer's state can be large (Hyena keeps each row's history), so no more are kept.
    def __init__(self, limit: int = 2) -> None:
        self.limit = limit
        self.entries: list[tuple[weakref.ref, CacheState]] = []

    @staticmethod
    def _free(owner: weakref.ref, state: CacheState) -> bool:
        cache = owner()
        return cache is None or get_state(cache) is not state

    def claim(self, cache: Any, parts: dict[str, CarriedState], seen_tokens: Optional[int]) -> Optional[CacheState]:
        """A free pinned state of `parts`' layout, now owned by `cache` and holding `parts`; None if none."""
        for index, (owner, state) in enumerate(self.entries):
            if self._free(owner, state) and state.can_take(parts):
                state.take(parts, seen_tokens)
                self.entries[index] = (weakref.ref(cache), state)
                return state
        return None

    def add(self, cache: Any, state: CacheState) -> None:
        if len(self.entries) >= self.limit:
            free = [i for i, (owner, kept) in enumerate(self.entries) if self._free(owner, kept)]
            if not free:
                return  # every kept state is in use: this one is not kept for reuse
            del self.entries[free[0]]
        self.entries.append((weakref.ref(cache), state))


def get_state(cache: Any) -> Optional[CacheState]:
    return getattr(cache, STATE_ATTR, None) if cache is not None else None


def set_state(cache: Any, state: Optional[CacheState]) -> None:
    setattr(cache, STATE_ATTR, state)


def _follow(method: Callable, transform: Callable[[CacheState, Any], Optional[CacheState]]) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        state = get_state(self)
        if state is not None:
            set_state(self, transform(state, args[0] if args else next(iter(kwargs.values()), None)))
        return result

    setattr(wrapper, _WRAPPED_FLAG, True)
    return wrapper


_TRANSFORMS: dict[str, Callable[[CacheState, Any], Optional[CacheState]]] = {
    "reorder_cache": lambda state, index: state.index_select(index),  # beam search
    "batch_select_indices": lambda state, index: state.index_select(index),
    "batch_repeat_interleave": lambda state, repeats: state.repeat_interleave(repeats),
    # no part can be rewound: a cropped cache must not be continued with a stale state
    "crop": lambda state, _: None,
    # a reset (reused) cache starts a new sequence
    "reset": lambda state, _: state.reset(),
}


def _not_croppable_with_state(original: Any) -> property:
    """`is_croppable` that is False while a state rides on the cache, else what the class said."""

    def is_croppable(self) -> bool:
        state = get_state(self)
        if state is not None and not state.empty:
            return False
        return original.fget(self) if isinstance(original, property) else bool(original)

    prop = property(is_croppable)
    setattr(prop.fget, _WRAPPED_FLAG, True)
    return prop


def _all_subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


def install() -> None:
    """Wrap the row-changing methods and `is_croppable` of transformers' cache classes (idempotent)."""
    from transformers import cache_utils

    for cls in _all_subclasses(cache_utils.Cache):
        for name, transform in _TRANSFORMS.items():
            method = cls.__dict__.get(name)
            if method is None or getattr(method, _WRAPPED_FLAG, False):
                continue
            setattr(cls, name, _follow(method, transform))
        croppable = cls.__dict__.get("is_croppable")
        if croppable is not None or cls is cache_utils.Cache:
            if isinstance(croppable, property) and getattr(croppable.fget, _WRAPPED_FLAG, False):
                continue
            setattr(cls, "is_croppable", _not_croppable_with_state(croppable if croppable is not None else True))
