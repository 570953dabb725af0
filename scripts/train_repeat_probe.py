"""Why a profile's train rows slow down after a few repeats: the training step of base, BEM and LoRA,
interleaved as the profiler times them, with the allocator's state and the collector's work per call.

    PYTHONPATH=. python scripts/train_repeat_probe.py --config configs/profile_llama_1b.yaml [--collect] [--no-pause]

Per timed call it prints ms, the CUDA allocator's retries and device allocations so far, reserved GiB, and,
with --collect, the objects `gc.collect()` found unreachable before the call (what the calls before it
left). --no-pause times without pausing the collector.
"""

from __future__ import annotations

import argparse
import gc
import json
import time

import torch

from bem.profiling import workloads
from bem.profiling.config import load_profile_config
from bem.profiling.models import build_variants, load_base_model
from bem.profiling.timing import Clock, warm_up_gpu


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--collect", action="store_true")
    parser.add_argument("--no-pause", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    config = load_profile_config(args.config)
    device = torch.device("cuda")
    base = load_base_model(config.model, device, config.seed)
    variants = build_variants(base, config.bem_config(), True)
    spec = config.train
    batches = workloads.random_batches(int(base.config.vocab_size), spec.batch_size, spec.sequence_length,
                                       config.seed + 31_337, device)
    runs = {}
    for key, model in variants.named().items():
        model.train()
        runs[key] = workloads.training_step(model, batches, spec.learning_rate, frozen_base=(key == "base"))
    warm_up_gpu(device, 2.0)
    clock = Clock(device)
    for key, run in runs.items():  # the profiler's warm-up rounds
        run(0)
    torch.cuda.synchronize()
    rows = []
    print(f"{'repeat':>6} {'variant':>7} {'ms':>8} {'retries':>8} {'cudaMalloc':>10} {'reserved GiB':>13} "
          f"{'unreachable':>11} {'host ms':>8}")
    names = list(runs)
    for repeat in range(args.repeats):
        for k in range(len(names)):
            key = names[(repeat + k) % len(names)]  # rotated, as the profiler does
            unreachable = gc.collect() if args.collect else -1  # what the last call left for the collector
            begin = time.perf_counter()
            ms = clock._time_ms(lambda: runs[key](repeat)) if args.no_pause else clock.time_ms(lambda: runs[key](repeat))
            host_ms = (time.perf_counter() - begin) * 1e3
            stats = torch.cuda.memory_stats(device)
            row = {"repeat": repeat, "variant": key, "ms": ms, "retries": stats.get("num_alloc_retries", 0),
                   "device_allocs": stats.get("num_device_alloc", 0),
                   "reserved_gib": stats.get("reserved_bytes.all.current", 0) / 2**30,
                   "unreachable": unreachable, "host_ms": host_ms}
            rows.append(row)
            print(f"{repeat:>6} {key:>7} {ms:>8.1f} {row['retries']:>8} {row['device_allocs']:>10} "
                  f"{row['reserved_gib']:>13.2f} {unreachable:>11} {host_ms:>8.1f}", flush=True)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)


if __name__ == "__main__":
    main()
