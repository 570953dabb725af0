"""The routing state rides on the KV cache object, so it follows the cache wherever `generate` takes it.

`Cache` methods that reorder, select, repeat, crop or reset rows are wrapped once (at import) so that
a cache carrying a BEM routing state transforms that state the same way. Caches without a state
behave exactly as before. Wrapping the classes, not each cache instance, keeps the model's forward
free of method patching, which `torch.compile` cannot trace.
"""

from __future__ import annotations

import functools
from typing import Any, Callable, Optional

from .modules.controller import RoutingState

STATE_ATTR = "_bem_routing_state"
_WRAPPED_FLAG = "_bem_wraps_routing_state"


def get_state(cache: Any) -> Optional[RoutingState]:
    return getattr(cache, STATE_ATTR, None) if cache is not None else None


def set_state(cache: Any, state: Optional[RoutingState]) -> None:
    setattr(cache, STATE_ATTR, state)


def _follow(method: Callable, transform: Callable[[RoutingState, Any], Optional[RoutingState]]) -> Callable:
    @functools.wraps(method)
    def wrapper(self, *args: Any, **kwargs: Any) -> Any:
        result = method(self, *args, **kwargs)
        state = get_state(self)
        if state is not None:
            set_state(self, transform(state, args[0] if args else next(iter(kwargs.values()), None)))
        return result

    setattr(wrapper, _WRAPPED_FLAG, True)
    return wrapper


_TRANSFORMS: dict[str, Callable[[RoutingState, Any], Optional[RoutingState]]] = {
    "reorder_cache": lambda state, index: state.index_select(index),  # beam search
    "batch_select_indices": lambda state, index: state.index_select(index),
    "batch_repeat_interleave": lambda state, repeats: state.repeat_interleave(repeats),
    # the routing state cannot be rewound: a cropped cache must not be continued with stale codes
    "crop": lambda state, _: None,
    # a reset (reused) cache starts a new sequence
    "reset": lambda state, _: None,
}


def _all_subclasses(cls: type) -> list[type]:
    found = [cls]
    for sub in cls.__subclasses__():
        found.extend(_all_subclasses(sub))
    return found


def install() -> None:
    """Wrap the row-changing methods of transformers' cache classes (idempotent)."""
    from transformers import cache_utils

    for cls in _all_subclasses(cache_utils.Cache):
        for name, transform in _TRANSFORMS.items():
            method = cls.__dict__.get(name)
            if method is None or getattr(method, _WRAPPED_FLAG, False):
                continue
            setattr(cls, name, _follow(method, transform))
