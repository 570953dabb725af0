"""Decoding, step by step: the frozen base against BEM, timed per decoding step with CUDA events.

    PYTHONPATH=. python scripts/decode_steps.py --config configs/profile_llama_1b.yaml [--config ...]
        [--batch 1,16] [--tokens 48] [--rounds 10] [--modes compiled,eager] [--variants base,bem,kernels]
        [--breakdown] [--json out.json]

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
"""

from __future__ import annotations

import argparse
import copy
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

import torch
from transformers import LogitsProcessorList

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_decode_breakdown import KINDS, kernel_times, per_decoding_step  # noqa: E402

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


def measure(config_path: str, batches: list[int], modes: list[str], names: list[str], tokens: int, rounds: int,
            breakdown: bool, device: torch.device, json_path: str = "", done: list = ()) -> list[dict[str, Any]]:
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
                rows.append(row)
                print(line(row), flush=True)
                for kernel, micros in row.get("top_kernels_us", []):
                    print(f"    {micros:8.1f} µs  {kernel}", flush=True)
                if json_path:  # row by row: a call cut off keeps what it measured
                    atomic_write_json(json_path, done + rows)
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
                        args.tokens, args.rounds, args.breakdown, device, args.json or "", list(rows))
    import transformers

    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}, transformers {transformers.__version__}; "
          f"ratio: median over rounds of the variant's step median over the base's [5th, 95th percentile]")
    for row in rows:
        print(line(row).split("  busy")[0])


if __name__ == "__main__":
    main()
