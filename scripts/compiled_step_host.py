"""Where a compiled decoding step's host time goes: the frozen base against BEM, by profiler event.

    PYTHONPATH=. python scripts/compiled_step_host.py --config configs/profile_smollm_135m.yaml [--batch 1]

`generate` with a static cache and its compiled decoding step (the profiler's `decode (compiled)` setting),
warmed up until compiled, then one generate of `--tokens` new tokens and one of 1 token under torch.profiler
(CPU activities only). Each event name's host time (self time, as the profiler reports it) in the second is
subtracted from the first and divided by the decoding steps; the events whose time differs most between the
base and BEM are printed, with the wall time per step of each. Then, without the profiler, `--repeats` pairs of
the two generates split each variant's wall time into the prompt's part (the 1-token generate) and a decoding
step's, as medians with their range.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections import defaultdict

import torch
from torch.profiler import ProfilerActivity, profile

from bem.profiling.timing import Clock
from compiled_decode_breakdown import compiled_generations, per_decoding_step


def host_times(run, device: torch.device) -> tuple[dict[str, float], dict[str, int], float]:
    """(self µs by event name, calls by event name, wall seconds) of one call of `run`."""
    start = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        run(0)
        if device.type == "cuda":
            torch.cuda.synchronize()
    wall = time.perf_counter() - start
    micros: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    for event in prof.key_averages():
        micros[event.key[:100]] += event.self_cpu_time_total
        calls[event.key[:100]] += event.count
    return dict(micros), dict(calls), wall


def wall_split(full, first, device: torch.device, tokens: int, repeats: int) -> str:
    """Median [min, max] wall ms of the 1-token generate and of a decoding step (the difference, per step)."""
    clock = Clock(device)  # as the sweep times (CUDA events on a GPU)
    prompts, steps = [], []
    for index in range(repeats):
        prompt, whole = (clock.time_ms(lambda: run(index)) for run in (first, full))
        prompts.append(prompt)
        steps.append((whole - prompt) / (tokens - 1))

    def show(values: list[float]) -> str:
        return f"{statistics.median(values):.3f} [{min(values):.3f}, {max(values):.3f}]"

    return f"1-token generate {show(prompts)} ms, decoding step {show(steps)} ms ({repeats} pairs, no profiler)"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--repeats", type=int, default=10, help="unprofiled pairs of generates timed per variant")
    args = parser.parse_args()
    device = torch.device(args.device)
    per_step: dict[str, dict[str, float]] = {}
    calls_per_step: dict[str, dict[str, float]] = {}
    for _, _, name, full, first in compiled_generations(args.config, [args.batch], args.tokens, device):
        (m_full, c_full, w_full), (m_first, c_first, w_first) = host_times(full, device), host_times(first, device)
        per_step[name] = per_decoding_step(m_full, m_first, args.tokens - 1)
        calls_per_step[name] = per_decoding_step(c_full, c_first, args.tokens - 1)
        print(f"{name}: {1e3 * (w_full - w_first) / (args.tokens - 1):.3f} ms a step (wall, under the profiler), "
              f"{sum(per_step[name].values()) / 1e3:.3f} ms of profiled host time", flush=True)
        if args.repeats > 0:
            print(f"{name}: {wall_split(full, first, device, args.tokens, args.repeats)}", flush=True)
    names = set(per_step["base"]) | set(per_step["bem"])
    rows = sorted(names, key=lambda k: -abs(per_step["bem"].get(k, 0.0) - per_step["base"].get(k, 0.0)))
    print(f"\n{'event':<100}{'base µs':>10}{'bem µs':>10}{'base n':>8}{'bem n':>8}   (per decoding step)")
    for key in rows[: args.top]:
        print(f"{key:<100}{per_step['base'].get(key, 0.0):>10.1f}{per_step['bem'].get(key, 0.0):>10.1f}"
              f"{calls_per_step['base'].get(key, 0.0):>8.1f}{calls_per_step['bem'].get(key, 0.0):>8.1f}")


if __name__ == "__main__":
    main()
