"""Training throughput and memory: BEM against PEFT LoRA at each profile config's shapes, in two precisions.

    python benchmarks/train_throughput.py --config configs/profile_qwen2_1.5b.yaml
    python benchmarks/train_throughput.py --sweep                     # the configs of `profile.py --sweep`
    python benchmarks/train_throughput.py --sweep smollm_135m,gpt2
    python benchmarks/train_throughput.py                             # the tiny CPU profile: a smoke run
    python benchmarks/train_throughput.py --processes 2 --config configs/profile_llama_1b.yaml --setups autocast
                                                                      # DDP and FSDP on 2 GPUs (train_multiprocess.py)

Per config, the base model of its `model` section is built once in bf16 (random weights), and per setup
(`train_setups.SETUPS`: bf16 parameters without autocast; fp32 adapters under bf16 autocast) it is
copied and wrapped by BEM and by PEFT LoRA with the same rank, alpha and modules (as `profile.py` pairs
them). Both train on the config's `train` batch; their steps are timed interleaved, repeat after
repeat, until the interval of BEM's speed over LoRA's is within the config's `timing.target_spread`
(or its repeat or time budget is spent). Then one step each, alone, for memory. One table for all.
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
import warnings
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # the bem package and the sibling helper, when run as a script
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from train_setups import SETUPS, Setup, kernel_note, set_trainable_dtype, step_memory, training_step  # noqa: E402

from bem.profiling.config import ProfileConfig, ProfileConfigError, load_profile_config  # noqa: E402
from bem.profiling.models import build_variants, load_base_model, resolve_device, vocab_size  # noqa: E402
from bem.profiling.statistics import median_interval, median_of_defined, per_repeat_ratios  # noqa: E402
from bem.profiling.stopping import StopRule  # noqa: E402
from bem.profiling.sweep import config_path, free_device_memory, sweep_names  # noqa: E402
from bem.profiling.table import columns  # noqa: E402
from bem.profiling.timing import Clock, interleaved_until, median, warm_up_gpu  # noqa: E402

KIND = "bem-train-throughput"
VARIANTS = ("bem", "lora")


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    source = parser.add_mutually_exclusive_group()
    source.add_argument("--config", type=Path, help="a profile config (default: the built-in tiny CPU profile)")
    source.add_argument("--sweep", nargs="?", const="all", metavar="NAMES",
                        help="several profile configs: all of profile.py's sweep, or comma-separated names / paths")
    parser.add_argument("--setups", default="bf16,autocast", help=f"comma-separated, of {', '.join(SETUPS)}")
    parser.add_argument("--batch-size", type=int, help="default: the config's train.batch_size")
    parser.add_argument("--seq-len", type=int, help="default: the config's train.sequence_length")
    parser.add_argument("--repeats", type=int, help="a fixed number of timed repeats (default: the config's timing)")
    parser.add_argument("--gradient-checkpointing", action="store_true", help="recompute the frozen base in backward")
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), help="default: the config's device")
    parser.add_argument("--json", type=Path, help="also write the rows here")
    parser.add_argument("--processes", type=int, default=1,
                        help="above 1: train under `accelerate launch` with this many processes (one per GPU), with "
                             "each of --strategies, and once with one process (train_multiprocess.py)")
    parser.add_argument("--strategies", default="ddp,fsdp", help="with --processes: comma-separated, of ddp, fsdp")
    parser.add_argument("--profile", type=Path, metavar="DIR",
                        help="with --processes: after the timed steps, trace two more under torch.profiler and write "
                             "process 0's busiest operators per launch and variant into DIR")
    # set by the launches of --processes: this process is one of them
    parser.add_argument("--worker", choices=("one", "ddp", "fsdp"), help=argparse.SUPPRESS)
    parser.add_argument("--worker-out", type=Path, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.processes < 1:
        parser.error(f"--processes must be at least 1, got {args.processes}")
    if args.processes > 1 and args.sweep is not None:
        parser.error("--processes takes one --config, not --sweep")
    return args


def load_configs(args: argparse.Namespace) -> list[tuple[str, ProfileConfig]]:
    if args.sweep is not None:
        return [(name, load_profile_config(config_path(name))) for name in sweep_names(args.sweep)]
    if args.config is not None:
        return [(str(args.config), load_profile_config(args.config))]
    return [("tiny", ProfileConfig())]


def chosen_setups(spec: str) -> list[Setup]:
    names = [name.strip() for name in spec.split(",")]
    unknown = [name for name in names if name not in SETUPS]
    if unknown or not names:
        raise ProfileConfigError(f"--setups takes names of {', '.join(SETUPS)}, got {spec!r}")
    return [SETUPS[name] for name in names]


def stop_rule(config: ProfileConfig, repeats: Optional[int]) -> StopRule:
    timing = config.timing
    if repeats is not None:
        return StopRule(repeats, repeats, timing.target_spread, timing.max_seconds)
    return StopRule(timing.min_repeats, timing.max_repeats, timing.target_spread, timing.max_seconds)


def speed_ratios(samples: dict[str, list[float]]) -> list[Optional[float]]:
    """BEM's tokens/s over LoRA's, minus one, per repeat (LoRA's step time over BEM's)."""
    return per_repeat_ratios(samples["lora"], samples["bem"])


def measure_setup(config: ProfileConfig, base: torch.nn.Module, setup: Setup, batches: list[torch.Tensor],
                  args: argparse.Namespace, device: torch.device) -> dict[str, Any]:
    with warnings.catch_warnings():  # deprecation notices from the libraries' own calls are not ours to show
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(), with_lora=True)
    if variants.lora is None:
        raise SystemExit(f"the training benchmark compares with PEFT LoRA: {variants.lora_note}")
    models = {"bem": variants.bem, "lora": variants.lora}
    steps, optimizers = {}, {}
    for key, model in models.items():
        set_trainable_dtype(model, setup.adapter_dtype)
        model.train()
        steps[key], optimizers[key] = training_step(model, batches, setup, config.train.learning_rate, device)
    timing = config.timing
    started = time.perf_counter()
    samples, reason = interleaved_until(steps, Clock(device), timing.warmup, stop_rule(config, args.repeats),
                                        lambda s: median_interval(speed_ratios(s), timing.confidence).half_width)
    seconds = time.perf_counter() - started
    memory = {key: step_memory(models[key], optimizers[key], steps[key], device) for key in VARIANTS}
    tokens = batches[0].numel()
    ratios = speed_ratios(samples)
    interval, point = median_interval(ratios, timing.confidence), median_of_defined(ratios)
    row = {
        "config": config.name, "setup": setup.name, "setup_description": setup.describe(),
        "batch": batches[0].shape[0], "sequence": batches[0].shape[1], "tokens_per_step": tokens,
        "repeats": len(samples["bem"]), "stop_reason": reason, "seconds": seconds, "confidence": timing.confidence,
        "bem_tokens_per_s": tokens / (median(samples["bem"]) / 1e3),
        "lora_tokens_per_s": tokens / (median(samples["lora"]) / 1e3),
        # BEM's tokens/s over LoRA's: the median per-repeat ratio and its interval (null: unbounded)
        "speed_vs_lora": {"point": None if point is None else 1.0 + point,
                          "low": None if interval.low is None else 1.0 + interval.low,
                          "high": None if interval.high is None else 1.0 + interval.high},
        "memory": memory,
        "memory_vs_lora": (memory["bem"]["peak_bytes"] / memory["lora"]["peak_bytes"]
                           if memory["lora"]["peak_bytes"] else None),
        "trainable_parameters": {key: sum(p.numel() for p in m.parameters() if p.requires_grad)
                                 for key, m in models.items()},
        "note": kernel_note(variants.bem, tokens, setup, device),
        "samples_ms": samples,
    }
    del variants, models, steps, optimizers
    free_device_memory()
    return row


def measure_config(config: ProfileConfig, setups: list[Setup], args: argparse.Namespace) -> list[dict[str, Any]]:
    device = resolve_device(args.device or config.device)
    warm_up_gpu(device, config.timing.gpu_warmup_seconds)
    base = load_base_model(replace(config.model, dtype="bfloat16"), device, config.seed)
    if args.gradient_checkpointing:
        from bem.training.model_factory import enable_gradient_checkpointing

        enable_gradient_checkpointing(base)
    batch = args.batch_size or config.train.batch_size
    length = args.seq_len or config.train.sequence_length
    generator = torch.Generator().manual_seed(config.seed)
    low = 3 if vocab_size(base) > 3 else 0  # away from the usual special ids, as the profiler's prompts
    batches = [torch.randint(low, vocab_size(base), (batch, length), generator=generator).to(device) for _ in range(3)]
    rows = [measure_setup(config, base, setup, batches, args, device) for setup in setups]
    del base
    free_device_memory()
    return rows


def _ratio(entry: Optional[dict]) -> str:
    if entry is None or entry["point"] is None:
        return "-"
    low = "-inf" if entry["low"] is None else f"{entry['low']:.3f}"
    high = "+inf" if entry["high"] is None else f"{entry['high']:.3f}"
    return f"{entry['point']:.3f} [{low}, {high}]"


def _gib(value: Optional[int]) -> str:
    return "n/a" if value is None else f"{value / 2**30:.2f}"


def format_table(rows: list[dict[str, Any]]) -> str:
    table = [["config", "setup", "batch x seq", "bem tok/s", "lora tok/s", "bem/lora speed [interval]",
              "bem peak GiB", "lora peak GiB", "bem/lora memory", "n", "note"]]
    for row in rows:
        if "error" in row:
            table.append([row["config"], row["setup"], "-", "-", "-", "-", "-", "-", "-", "-", row["error"]])
            continue
        memory = row["memory"]
        table.append([row["config"], row["setup"], f"{row['batch']} x {row['sequence']}",
                      f"{row['bem_tokens_per_s']:.0f}", f"{row['lora_tokens_per_s']:.0f}", _ratio(row["speed_vs_lora"]),
                      _gib(memory["bem"]["peak_bytes"]), _gib(memory["lora"]["peak_bytes"]),
                      "n/a" if row["memory_vs_lora"] is None else f"{row['memory_vs_lora']:.3f}",
                      str(row["repeats"]), row["note"]])
    lines = columns(table, left=2)
    described = {row["setup"]: row.get("setup_description") for row in rows if "error" not in row}
    lines += [f"{name}: {text}" for name, text in described.items()]
    confidence = next((row["confidence"] for row in rows if "error" not in row), None)
    if confidence is not None:
        lines.append(f"speed: median per-repeat ratio of tokens/s with its {100 * confidence:g}% interval; peak: the "
                     f"variant's parameters and optimizer state plus its step's peak allocation (GPU only)")
    return "\n".join(lines)


def main_processes(args: argparse.Namespace, configs: list[tuple[str, ProfileConfig]], setups: list[Setup]) -> int:
    """--processes N: the one-process launch and one launch per strategy, BEM and LoRA in each; one table."""
    import train_multiprocess

    if args.worker is not None:
        if len(setups) != 1:
            raise ProfileConfigError("a launched worker takes one setup")
        return train_multiprocess.worker_main(args, configs[0][1])
    try:
        train_multiprocess.strategies(args.strategies)
    except ValueError as err:
        raise ProfileConfigError(str(err)) from None
    config_arg = None if args.config is None else str(args.config)
    rows = train_multiprocess.measure(Path(__file__).resolve(), config_arg, [s.name for s in setups], args)
    print(train_multiprocess.format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"kind": KIND + "-processes", "config": configs[0][0], "rows": rows},
                                        indent=2) + "\n")
    return 1 if any("error" in row for row in rows) else 0


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    try:
        configs = load_configs(args)
        setups = chosen_setups(args.setups)
        if args.processes > 1 or args.worker is not None:
            return main_processes(args, configs, setups)
    except ProfileConfigError as err:
        print(f"train_throughput: {err}", file=sys.stderr)
        return 2
    rows: list[dict[str, Any]] = []
    for name, config in configs:
        print(f"{name}: {', '.join(s.name for s in setups)}", file=sys.stderr)
        try:
            rows += measure_config(config, setups, args)
        except ProfileConfigError as err:
            print(f"train_throughput: {err}", file=sys.stderr)
            return 2
        except Exception as err:  # noqa: BLE001 - in a sweep, one config's failure is shown; the others run
            if len(configs) == 1:
                raise
            rows += [{"config": config.name, "setup": s.name, "error": f"{type(err).__name__}: {err}"} for s in setups]
            gc.collect()
            free_device_memory()
    print(format_table(rows))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"kind": KIND, "rows": rows}, indent=2) + "\n")
    return 1 if any("error" in row for row in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
