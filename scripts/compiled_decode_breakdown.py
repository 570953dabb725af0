"""Where a compiled decoding step's device time goes: the frozen base against BEM, kernel by kernel.

    PYTHONPATH=. python scripts/compiled_decode_breakdown.py --config configs/profile_smollm_135m.yaml \
        [--batch 1,16] [--tokens 32] [--json out.json]

For each profile config and batch size: `generate` with a static cache and its compiled decoding step (the
profiler's `decode (compiled)` setting, same backend), warmed up until compiled, then one more generate of
`--tokens` new tokens under torch.profiler. Kernel time is grouped by kind (BEM's decode linears, cuBLAS and
other GEMMs, attention, inductor's fused kernels, the rest) and divided by the decoding steps; the prompt's
prefill is in the trace too, so a 1-token generate is profiled as well and subtracted.
"""

from __future__ import annotations

import argparse
import json
import re
import warnings
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from torch.profiler import ProfilerActivity, profile

from bem.profiling.config import load_profile_config
from bem.profiling.models import build_variants, load_base_model
from bem.profiling.workloads import generation, random_batches

KINDS = (  # first match wins
    ("bem decode linear", re.compile(r"decode_(stream|linear|project|columns|rows)")),
    ("bem other", re.compile(r"bem|lowrank|scale_codes|gemm_update")),
    ("gemm / gemv", re.compile(r"gemv|gemm|nvjet|cutlass|xmma|cublas|splitK", re.I)),
    ("attention", re.compile(r"flash|fmha|attention|sdpa|efficient", re.I)),
    ("inductor fused", re.compile(r"^triton_")),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def kernel_times(run, index: int, device: torch.device) -> tuple[dict[str, float], dict[str, int], dict[str, float]]:
    """(µs by kind, kernel count by kind, µs by kernel name) of one call of `run` under the profiler (on a
    CPU, which has no kernels, nothing: the script's flow can still be tried there)."""
    with profile(activities=[ProfilerActivity.CUDA if device.type == "cuda" else ProfilerActivity.CPU]) as prof:
        run(index)
        if device.type == "cuda":
            torch.cuda.synchronize()
    by_kind: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    by_name: dict[str, float] = defaultdict(float)
    for event in prof.events():
        if event.device_type != torch.autograd.DeviceType.CUDA:
            continue
        micros = event.device_time
        if micros <= 0:
            continue
        kind = kind_of(event.name)
        by_kind[kind] += micros
        count[kind] += 1
        by_name[event.name[:160]] += micros
    return dict(by_kind), dict(count), dict(by_name)


def per_decoding_step(full: dict[str, float], first: dict[str, float], steps: int) -> dict[str, float]:
    """What the generate of `steps` more tokens adds over the 1-token one (its prefill), per step."""
    return {k: (full.get(k, 0.0) - first.get(k, 0.0)) / steps for k in set(full) | set(first)}


def compiled_generations(config_path: str, batches: list[int], tokens: int, device: torch.device
                         ) -> Iterator[tuple[str, int, str, Callable, Callable]]:
    """(config name, batch, variant, generate of `tokens` new tokens, generate of 1) for the frozen base and BEM
    at each batch size: a static cache and generate's compiled decoding step, compiled and settled."""
    config = load_profile_config(config_path)
    base = load_base_model(config.model, device, config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(), with_lora=False)
    pad = getattr(base.config, "pad_token_id", None) or 0
    for batch in batches:
        ids = random_batches(base.config.vocab_size, batch, config.decode.prompt_length, config.seed, device)
        for name, model in (("base", variants.base), ("bem", variants.bem)):
            full = generation(model, ids, tokens, pad, config.decode.compile_backend)
            first = generation(model, ids, 1, pad, config.decode.compile_backend)
            for index in range(3):  # compile, then settle
                full(index)
                first(index)
            yield config.name, batch, name, full, first


def breakdown(config_path: str, batches: list[int], tokens: int, device: torch.device) -> list[dict[str, Any]]:
    rows = []
    for config_name, batch, name, full, first in compiled_generations(config_path, batches, tokens, device):
        # each of (µs by kind, launches by kind, µs by name), per decoding step
        per_step, launches, names = (per_decoding_step(a, b, tokens - 1) for a, b in
                                     zip(kernel_times(full, 0, device), kernel_times(first, 0, device)))
        top = sorted(names.items(), key=lambda item: -item[1])[:15]
        rows.append({"config": config_name, "batch": batch, "variant": name, "us_per_step": per_step,
                     "kernels_per_step": launches, "busy_us_per_step": sum(per_step.values()),
                     "top_kernels_us": top})
        print_rows(rows[-1:], header=len(rows) == 1)  # as it comes: compiling takes most of a run's time
    return rows


def print_rows(rows: list[dict[str, Any]], header: bool = True, top: bool = True) -> None:
    kinds = [k for k, _ in KINDS] + ["other"]
    if header:
        print(f"{'config':<14}{'b':>3} {'variant':<6}{'busy µs/step':>13}  " + "  ".join(f"{k:>18}" for k in kinds))
    for row in rows:
        cells = [f"{row['us_per_step'].get(k, 0.0):9.1f} ({row['kernels_per_step'].get(k, 0.0):4.0f})" for k in kinds]
        print(f"{row['config']:<14}{row['batch']:>3} {row['variant']:<6}{row['busy_us_per_step']:>13.1f}  "
              + "  ".join(f"{c:>18}" for c in cells))
    if header:
        print("µs of device time per decoding step (kernels per step); the prompt's prefill subtracted")
    for row in rows if top else []:
        print(f"\n{row['config']} b{row['batch']} {row['variant']}: busiest kernels, µs per step")
        for name, micros in row["top_kernels_us"]:
            print(f"  {micros:8.1f}  {name}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", action="append", required=True)
    parser.add_argument("--batch", default="1,16")
    parser.add_argument("--tokens", type=int, default=32)
    parser.add_argument("--json")
    parser.add_argument("--device", default="cuda")
    args = parser.parse_args()
    device = torch.device(args.device)
    rows = []
    for config in args.config:
        rows += breakdown(config, [int(b) for b in args.batch.split(",")], args.tokens, device)
        if device.type == "cuda":
            torch.cuda.empty_cache()
    print("\nall rows:")
    print_rows(rows, top=False)
    if args.json:
        Path(args.json).write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
