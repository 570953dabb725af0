"""Decoding, step by step: the frozen base against BEM, timed per decoding step with CUDA events.

    PYTHONPATH=. python scripts/decode_steps.py --config configs/profile_llama_1b.yaml [--config ...]
        [--batch 1,16] [--tokens 48] [--rounds 10] [--modes compiled,eager] [--variants base,bem,kernels]
        [--breakdown] [--host] [--json out.json]

Whole `generate` calls time the prompt's prefill, the host's set-up and the decoding steps together, and
their spread between repeats is wider than the overhead they measure. Here a logits processor records a CUDA
event as each step's logits come out, so each step's time is the gap between two events: what a user waits
per token, device idle time included. Each generate call gives its steps' median; the variants run
interleaved, round by round (the first variant rotating), and the table gives the median over rounds of
each round's BEM-over-base ratio with its 5th-95th percentile range.

Variants: `base` (the frozen model), `bem` (as created: generate's compiled step takes the joint [W; Vᵀ] GEMM,
one for the layers that share an input), `ungrouped` (BEM with `joint_groups` off: one joint GEMM a layer),
`kernels` (BEM with `joint_weights` off: the fused kernels in the compiled step too), `lora` (PEFT LoRA).
Modes: `compiled` (a static cache and generate's compiled decoding step, as users deploy), `eager` (the
dynamic cache). `--breakdown`: each compiled variant's device time per step by kernel kind, from the profiler.
`--host`: each compiled variant's host time per step by profiler event (the events BEM changes most, against the
base) and the Python functions a stack sampler finds the host in most often, during decoding.
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import threading
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_decode_breakdown import KINDS, kernel_times, per_decoding_step  # noqa: E402
from compiled_step_host import host_times  # noqa: E402
from stack_sampler import StackSampler  # noqa: E402

from bem import create_hierarchical_bem  # noqa: E402
from bem.io_utils import atomic_write_json  # noqa: E402
from bem.profiling.config import load_profile_config  # noqa: E402
from bem.profiling.models import build_variants, load_base_model  # noqa: E402
from bem.profiling.timing import warm_up_gpu  # noqa: E402
from bem.profiling.workloads import StepTimes, generation, random_batches  # noqa: E402


def decoder(model: torch.nn.Module, ids: torch.Tensor, pad: int, mode: str):
    """run(tokens, timed): greedy generate of `tokens` new tokens (compiled: a static cache and generate's compiled
    step); with `timed`, the gaps (ms) between successive steps' logits."""
    backend = "inductor" if mode == "compiled" else None
    workloads: dict[int, Any] = {}

    def run(tokens: int, timed: bool = False) -> list[float]:
        if tokens not in workloads:
            workloads[tokens] = generation(model, [ids], tokens, pad, backend)
        timer = StepTimes(cuda=True)
        workloads[tokens](0, logits_processor=LogitsProcessorList([timer]))
        return timer.step_ms() if timed else []

    return run


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    position = q * (len(ordered) - 1)
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


# BEM variants that differ from `bem` in the form of generate's compiled step (BEMModel attributes)
OTHER_FORMS = {"kernels": {"joint_weights": False}, "ungrouped": {"joint_groups": False}}


def models_for(config_path: str, names: list[str], device: torch.device):
    config = load_profile_config(config_path)
    base = load_base_model(config.model, device, config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(), with_lora="lora" in names)
    models = {"base": variants.base, "bem": variants.bem}
    for name, form in OTHER_FORMS.items():
        if name in names:
            model = create_hierarchical_bem(copy.deepcopy(base), config.bem_config()).eval()
            for attribute, value in form.items():
                setattr(model, attribute, value)
            models[name] = model
    if variants.lora is not None:
        models["lora"] = variants.lora
    return config, base, {name: models[name] for name in names if name in models}


def host_profile(run, tokens: int, device: torch.device) -> dict[str, Any]:
    """Host µs and calls per decoding step by profiler event, and the sampler's top Python functions (share of
    samples)."""
    full = lambda _i: run(tokens)  # noqa: E731
    first = lambda _i: run(1)  # noqa: E731
    (micros_full, calls_full, _), (micros_first, calls_first, _) = host_times(full, device), host_times(first, device)
    with StackSampler(thread=threading.get_ident()) as sampler:  # generate's thread, not the compile workers'
        for _ in range(3):
            run(tokens)
    total = max(sampler.samples, 1)
    return {"host_us_per_step": per_decoding_step(micros_full, micros_first, tokens - 1),
            "host_calls_per_step": per_decoding_step(calls_full, calls_first, tokens - 1),
            "host_self_share": [(name, count / total) for name, count in sampler.self_counts.most_common(40)],
            "host_inclusive_share": [(name, count / total) for name, count in sampler.inclusive.most_common(60)]}


def print_host(rows: list[dict[str, Any]], top: int = 25) -> None:
    """The host events whose time per step differs most from the base's, for each other variant."""
    base = next((row for row in rows if row["variant"] == "base" and "host_us_per_step" in row), None)
    for row in rows:
        if base is None or row is base or "host_us_per_step" not in row:
            continue
        ours, theirs = row["host_us_per_step"], base["host_us_per_step"]
        our_calls, their_calls = row["host_calls_per_step"], base["host_calls_per_step"]
        print(f"  host, {row['variant']} against base (µs and calls a step; profiled totals {sum(ours.values()):.0f}"
              f" / {sum(theirs.values()):.0f}):")
        for key in sorted(set(ours) | set(theirs), key=lambda k: -abs(ours.get(k, 0.0) - theirs.get(k, 0.0)))[:top]:
            print(f"    {ours.get(key, 0.0):9.1f} {theirs.get(key, 0.0):9.1f} {our_calls.get(key, 0.0):7.1f} "
                  f"{their_calls.get(key, 0.0):7.1f}  {key}")
    for row in rows:
        if "host_self_share" not in row:
            continue
        print(f"  host, {row['variant']}: the sampler's top functions (self share of samples)")
        for name, share in row["host_self_share"][:12]:
            print(f"    {100 * share:5.1f}%  {name[:110]}")


def measure(config_path: str, batches: list[int], modes: list[str], names: list[str], tokens: int, rounds: int,
            breakdown: bool, device: torch.device, json_path: str = "", done: list = (),
            host: bool = False) -> list[dict[str, Any]]:
    config, base, models = models_for(config_path, names, device)
    pad = getattr(base.config, "pad_token_id", None) or 0
    rows = []
    for mode in modes:
        for batch in batches:
            ids = random_batches(base.config.vocab_size, batch, config.decode.prompt_length, config.seed, device)[0]
            runs = {name: decoder(model, ids, pad, mode) for name, model in models.items()}
            compile_s = {}
            for name, run in runs.items():
                started = time.perf_counter()
                for _ in range(3):  # compile, capture, settle
                    run(tokens)
                torch.cuda.synchronize()
                compile_s[name] = time.perf_counter() - started
            warm_up_gpu(device, 1.0)
            medians: dict[str, list[float]] = {name: [] for name in runs}
            order = list(runs)
            for index in range(rounds):
                for name in order[index % len(order):] + order[:index % len(order)]:
                    steps = runs[name](tokens, timed=True)[1:]  # the first gap follows the prefill's logits
                    medians[name].append(statistics.median(steps))
            for name in runs:
                ratios = [v / b for v, b in zip(medians[name], medians["base"])]
                row = {"config": config.name, "mode": mode, "batch": batch, "variant": name,
                       "ms_per_step": statistics.median(medians[name]), "ratio": statistics.median(ratios),
                       "ratio_p5": percentile(ratios, 0.05), "ratio_p95": percentile(ratios, 0.95),
                       "rounds": rounds, "tokens": tokens, "warm_s": round(compile_s[name], 1)}
                if breakdown and mode == "compiled":
                    full = lambda _i, run=runs[name]: run(tokens)  # noqa: E731
                    first = lambda _i, run=runs[name]: run(1)  # noqa: E731
                    per_step, launches, names_us = (per_decoding_step(a, b, tokens - 1) for a, b in
                                                    zip(kernel_times(full, 0, device), kernel_times(first, 0, device)))
                    row.update(us_per_step=per_step, kernels_per_step=launches,
                               busy_us_per_step=sum(per_step.values()),
                               top_kernels_us=sorted(names_us.items(), key=lambda item: -item[1])[:30])
                if host and mode == "compiled":
                    row.update(host_profile(runs[name], tokens, device))
                rows.append(row)
                print(line(row), flush=True)
                for kernel, micros in row.get("top_kernels_us", []):
                    print(f"    {micros:8.1f} µs  {kernel}", flush=True)
                if json_path:  # row by row: a call cut off keeps what it measured
                    atomic_write_json(json_path, done + rows)
            if host and mode == "compiled":
                print_host([row for row in rows if row["batch"] == batch and row["mode"] == mode])
    del models
    torch.cuda.empty_cache()
    return rows


def line(row: dict[str, Any]) -> str:
    text = (f"{row['config']:<14} {row['mode']:<9} b{row['batch']:<3} {row['variant']:<8} "
            f"{row['ms_per_step']:8.3f} ms/step  x{row['ratio']:.3f} [{row['ratio_p5']:.3f}, {row['ratio_p95']:.3f}]"
            f"  n={row['rounds']} warm {row['warm_s']} s")
    if "busy_us_per_step" in row:
        kinds = [k for k, _ in KINDS] + ["other"]
        text += f"  busy {row['busy_us_per_step']:.1f} µs: " + ", ".join(
            f"{k} {row['us_per_step'].get(k, 0.0):.1f} ({row['kernels_per_step'].get(k, 0.0):.0f})" for k in kinds)
    return text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--modes", default="compiled")
    parser.add_argument("--variants", default="base,bem,kernels")
    parser.add_argument("--tokens", type=int, default=48)
    parser.add_argument("--rounds", type=int, default=10)
    parser.add_argument("--breakdown", action="store_true")
    parser.add_argument("--host", action="store_true")
    parser.add_argument("--json")
    args = parser.parse_args()
    device = torch.device("cuda")
    names = args.variants.split(",")
    if names[0] != "base":
        parser.error("--variants must start with base (the ratios' denominator)")
    unknown = sorted(set(names) - {"base", "bem", "lora", *OTHER_FORMS})
    if unknown:
        parser.error(f"unknown variant {unknown[0]!r}; the variants are base, bem, {', '.join(OTHER_FORMS)}, lora")
    rows: list[dict[str, Any]] = []
    for config in args.config:
        rows += measure(config, [int(b) for b in args.batch.split(",")], args.modes.split(","), names,
                        args.tokens, args.rounds, args.breakdown, device, args.json or "", list(rows), args.host)
    import transformers

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"ratio: median over rounds of the variant's step median over the base's [5th, 95th percentile]")
    for row in rows:
        print(line(row).split("  busy")[0])


if __name__ == "__main__":
    main()
