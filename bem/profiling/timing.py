"""Trustworthy wall-clock timing: CUDA events on the GPU, `perf_counter` on the CPU, variants interleaved.

Variants are timed round-robin within each repeat, with the starting variant rotated from one repeat
to the next, so drifting clocks, thermal state or a noisy neighbour affect every variant alike.
`interleaved` runs a fixed number of repeats; `interleaved_until` adds repeats until a `StopRule` says
the spread is small enough or the budget is spent.

Each timed call runs with Python's cyclic garbage collector paused, as `timeit` times: a full collection in
a process holding these models takes about 200 ms (measured in a 1B model's training process on an H100)
and would land in whichever variant's repeat was running. Collections due meanwhile run between the calls.
"""

from __future__ import annotations

import gc
import statistics
import time
from typing import Any, Callable

import torch

from .stopping import StopRule

# A workload takes the repeat index (to rotate its inputs) and returns anything.
Workload = Callable[[int], Any]


class Clock:
    """Times one call in milliseconds on `device`."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.cuda = device.type == "cuda"

    @property
    def method(self) -> str:
        return "cuda_events" if self.cuda else "perf_counter"

    def synchronize(self) -> None:
        if self.cuda:
            torch.cuda.synchronize(self.device)

    def time_ms(self, fn: Callable[[], Any]) -> float:
        return _collector_paused(lambda: self._time_ms(fn))

    def self_timed_ms(self, fn: Callable[[], float]) -> float:
        """What `fn` measures of itself (ms), run as `time_ms` runs a call: the garbage collector paused."""
        return float(_collector_paused(fn))

    def _time_ms(self, fn: Callable[[], Any]) -> float:
        if self.cuda:
            start = torch.cuda.Event(enable_timing=True)
            end = torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(self.device)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return float(start.elapsed_time(end))
        begin = time.perf_counter()
        fn()
        return (time.perf_counter() - begin) * 1e3


def _collector_paused(fn: Callable[[], Any]) -> Any:
    enabled = gc.isenabled()
    gc.disable()
    try:
        return fn()
    finally:
        if enabled:
            gc.enable()


def warm_up_gpu(device: torch.device, seconds: float) -> int:
    """Run large bf16 matrix products for `seconds` so the GPU reaches its working clocks; returns the count."""
    if device.type != "cuda" or seconds <= 0:
        return 0
    a = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    b = torch.randn(4096, 4096, device=device, dtype=torch.bfloat16)
    count, deadline = 0, time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        for _ in range(10):
            a @ b
        torch.cuda.synchronize(device)
        count += 10
    return count


def _warm_up(workloads: dict[str, Workload], clock: Clock, warmup: int) -> None:
    for index in range(warmup):
        for name in workloads:
            workloads[name](index)
    clock.synchronize()


def _timed_round(workloads: dict[str, Workload], clock: Clock, index: int, samples: dict[str, list[float]]) -> None:
    """One repeat: every workload once, starting from a different one each repeat. A workload marked
    `self_timed` returns its own measurement (ms); the others are timed whole."""
    names = list(workloads)
    shift = index % len(names)
    for name in names[shift:] + names[:shift]:
        run = workloads[name]
        measure = clock.self_timed_ms if getattr(run, "self_timed", False) else clock.time_ms
        samples[name].append(measure(lambda: run(index)))


def interleaved(workloads: dict[str, Workload], clock: Clock, warmup: int, repeats: int) -> dict[str, list[float]]:
    """Samples (ms) per workload: `warmup` untimed rounds, then `repeats` timed round-robin rounds."""
    _warm_up(workloads, clock, warmup)
    samples: dict[str, list[float]] = {name: [] for name in workloads}
    for index in range(repeats):
        _timed_round(workloads, clock, index, samples)
    return samples


SpreadOf = Callable[[dict[str, list[float]]], float]


def interleaved_until(workloads: dict[str, Workload], clock: Clock, warmup: int, rule: StopRule,
                      spread_of: SpreadOf, now: Callable[[], float] = time.perf_counter,
                      ) -> tuple[dict[str, list[float]], str]:
    """Samples (ms) per workload and why the repeats stopped: after `warmup` untimed rounds, timed
    round-robin rounds until `rule` stops them, given `spread_of(samples so far)` (checked from
    `rule.min_repeats` on) and the seconds the timed rounds have taken."""
    _warm_up(workloads, clock, warmup)
    samples: dict[str, list[float]] = {name: [] for name in workloads}
    started = now()
    index = 0
    while True:
        _timed_round(workloads, clock, index, samples)
        index += 1
        spread = spread_of(samples) if index >= rule.min_repeats else float("inf")
        reason = rule.reason(index, spread, now() - started)
        if reason is not None:
            return samples, reason


def median(samples: list[float]) -> float:
    return float(statistics.median(samples))
