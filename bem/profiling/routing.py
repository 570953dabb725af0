"""The controller's own cost: replay the exact call it received inside a real BEM forward.

During one BEM prefill (or one `generate`), the controller's `forward` (or `step`) is wrapped to keep
its last arguments: the hidden states entering the first block, the mask, the routing state. Timing
that call alone, interleaved with the full models, gives the routing share of BEM's time.
"""

from __future__ import annotations

import contextlib
from typing import Any, Iterator, Optional

import torch
import torch.nn as nn

from .timing import Workload


class LastCall:
    def __init__(self) -> None:
        self.args: Optional[tuple] = None
        self.kwargs: dict[str, Any] = {}


@contextlib.contextmanager
def capture_last_call(module: nn.Module, method: str) -> Iterator[LastCall]:
    """Record the arguments of the last `module.<method>(...)` made inside the block."""
    record = LastCall()
    original = getattr(module, method)

    def recording(*args: Any, **kwargs: Any) -> Any:
        record.args, record.kwargs = args, kwargs
        return original(*args, **kwargs)

    setattr(module, method, recording)  # an instance attribute shadows the class method
    try:
        yield record
    finally:
        delattr(module, method)


def replay(module: nn.Module, method: str, record: LastCall) -> Workload:
    if record.args is None:
        raise RuntimeError(f"the controller's {method} was never called; is routing enabled in the BEM config?")
    bound = module if method == "forward" else getattr(module, method)  # __call__ as in real use
    args, kwargs = record.args, record.kwargs

    def run(_: int) -> Any:
        with torch.inference_mode():
            return bound(*args, **kwargs)

    return run
