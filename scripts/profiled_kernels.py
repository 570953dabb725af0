"""Each CUDA kernel's device time per call of a function, from torch.profiler: the helper of the
`*_kernel_times.py` scripts (imported by name: scripts run with their own folder on the path)."""

from __future__ import annotations

from collections import defaultdict
from typing import Callable

import torch
from torch.profiler import ProfilerActivity, profile


def kernel_times(fn: Callable[[], object], calls: int, name_width: int = 100) -> dict[str, float]:
    """Device µs per call of each kernel name (cut to `name_width` characters) that `fn` launches, after three
    warm-up calls."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    per_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            per_name[event.name[:name_width]] += event.device_time / calls
    return dict(per_name)
