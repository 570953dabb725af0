"""Training throughput on several processes: BEM and PEFT LoRA under the same launch, with DDP and FSDP,
against one process with the same per-process batch.

    python benchmarks/train_throughput.py --processes 2 --config configs/profile_llama_1b.yaml --setups autocast

Each (strategy, setup) is one `accelerate launch` of this benchmark with `--processes` processes (one, for the
one-process row), as users launch `bem train`. Inside it, every process builds the same base (bf16, the config's
seed), then BEM and LoRA in turn: wrapped, handed to accelerate the way `bem train` does it
(`bem.training.distributed`: DDP, or FSDP2 with BEM's controller kept whole), trained for the warm-up and the
timed steps on its own random batch, and freed. A step's time is the slowest process's; tokens/s counts every
process's tokens. Peak memory is each process's largest allocation over the timed steps (GPUs only).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from dataclasses import replace
from pathlib import Path
from typing import Any, Optional

import torch

STRATEGIES = ("ddp", "fsdp")
ONE = "one"  # the one-process launch every strategy is compared with
VARIANTS = ("bem", "lora")


# ---------------------------------------------------------------------------------------------- parent
def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _launch(script: Path, worker_args: list[str], processes: int, mixed_precision: str, timeout: float,
            ) -> dict[str, Any]:
    """One `accelerate launch` of the worker; its process 0's record, or {"error": ...}."""
    with tempfile.TemporaryDirectory() as folder:
        out = Path(folder) / "record.json"
        command = [sys.executable, "-m", "accelerate.commands.launch", "--num_processes", str(processes),
                   "--num_machines", "1", "--mixed_precision", mixed_precision, "--dynamo_backend", "no",
                   "--main_process_port", str(_free_port())]
        if processes > 1:
            command.append("--multi_gpu")  # several processes; on the CPU, gloo
        command += [str(script), *worker_args, "--worker-out", str(out)]
        env = {**os.environ, "HF_HOME": str(Path(folder) / "hf_home")}  # no accelerate config of the user's
        if not torch.cuda.is_available():
            env.setdefault("OMP_NUM_THREADS", "1")
        try:
            done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"the launch took more than {timeout:.0f} s"}
        if done.returncode != 0 or not out.is_file():
            tail = " | ".join((done.stderr or done.stdout).strip().splitlines()[-3:])
            return {"error": f"exit {done.returncode}: {tail}"}
        return json.loads(out.read_text())


def worker_arguments(config_arg: Optional[str], setup: str, strategy: str, args: argparse.Namespace) -> list[str]:
    forwarded = ["--worker", strategy, "--setups", setup, "--repeats", str(args.repeats or 10)]
    if config_arg is not None:
        forwarded += ["--config", config_arg]
    for flag, value in (("--batch-size", args.batch_size), ("--seq-len", args.seq_len), ("--device", args.device)):
        if value is not None:
            forwarded += [flag, str(value)]
    if args.gradient_checkpointing:
        forwarded.append("--gradient-checkpointing")
    if getattr(args, "profile", None) is not None:
        forwarded += ["--profile", str(args.profile)]
    return forwarded


def strategies(spec: str) -> list[str]:
    names = [name.strip() for name in spec.split(",") if name.strip()]
    unknown = [name for name in names if name not in STRATEGIES]
    if unknown or not names:
        raise ValueError(f"--strategies takes names of {', '.join(STRATEGIES)}, got {spec!r}")
    return names


def measure(script: Path, config_arg: Optional[str], setups: list[str], args: argparse.Namespace,
            timeout: float = 1800.0) -> list[dict[str, Any]]:
    """Every (setup, strategy) launch, the one-process launch first: one row per (setup, strategy, variant)."""
    rows = []
    for setup in setups:
        mixed = "bf16" if setup == "autocast" else "no"
        launches = [(ONE, 1)] + [(name, args.processes) for name in strategies(args.strategies)]
        for strategy, processes in launches:
            print(f"{config_arg or 'tiny'}: {setup}, {strategy} on {processes} process(es)", file=sys.stderr)
            record = _launch(script, worker_arguments(config_arg, setup, strategy, args), processes, mixed, timeout)
            if "error" in record:
                rows += [{"setup": setup, "strategy": strategy, "processes": processes, "variant": variant,
                          "error": record["error"]} for variant in VARIANTS]
                continue
            rows += record["rows"]
    return with_scaling(rows)


def with_scaling(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Each row's tokens/s per process over the one-process row's (same setup and variant), and BEM's
    tokens/s over LoRA's under the same launch."""
    def key(row, strategy=None, variant=None):
        return (row["setup"], strategy or row["strategy"], variant or row["variant"])

    by_key = {key(row): row for row in rows if "error" not in row}
    for row in rows:
        if "error" in row:
            continue
        one = by_key.get(key(row, strategy=ONE))
        row["per_process_vs_one"] = (row["tokens_per_s_per_process"] / one["tokens_per_s_per_process"]
                                     if one else None)
        lora = by_key.get(key(row, variant="lora"))
        row["bem_vs_lora"] = row["tokens_per_s"] / lora["tokens_per_s"] if lora and row["variant"] == "bem" else None
    return rows


def format_table(rows: list[dict[str, Any]]) -> str:
    from bem.profiling.table import columns

    table = [["setup", "strategy", "procs", "variant", "tok/s", "tok/s per proc", "x one proc", "bem/lora",
              "peak GiB per proc", "loss first", "loss last"]]
    for row in rows:
        head = [row["setup"], row["strategy"], str(row["processes"]), row["variant"]]
        if "error" in row:
            table.append(head + ["-"] * 6 + [row["error"][:80]])
            continue
        peaks = row["peak_bytes_by_process"]
        table.append(head + [
            f"{row['tokens_per_s']:.0f}", f"{row['tokens_per_s_per_process']:.0f}",
            "-" if row["per_process_vs_one"] is None else f"{row['per_process_vs_one']:.3f}",
            "-" if row["bem_vs_lora"] is None else f"{row['bem_vs_lora']:.3f}",
            "n/a" if peaks is None else " ".join(f"{p / 2**30:.2f}" for p in peaks),
            f"{row['losses'][0]:.4f}", f"{row['losses'][-1]:.4f}"])
    lines = columns(table, left=4)
    lines.append("tok/s: every process's tokens over the median step time of the slowest process; x one proc: "
                 "tokens/s per process over the one-process launch's; peak: each process's largest allocation")
    return "\n".join(lines)


# ---------------------------------------------------------------------------------------------- worker
def _wrap(variant: str, base: torch.nn.Module, config) -> torch.nn.Module:
    """`base` wrapped in place (no copy: a second base would count in the variant's memory)."""
    from bem import create_hierarchical_bem
    from bem.profiling.models import lora_on
    from bem.targets import plan_targets

    bem_config = config.bem_config()
    if variant == "bem":
        return create_hierarchical_bem(base, bem_config)
    return lora_on(base, plan_targets(base, bem_config).names, bem_config)  # the linears BEM wraps


def _sharded_fraction(model: torch.nn.Module) -> float:
    """The share of the prepared model's parameter elements held as FSDP shards (DTensors)."""
    from bem.training.distributed import _dtensor_class

    dtensor = _dtensor_class()
    total = sharded = 0
    for parameter in model.parameters():
        total += parameter.numel()
        sharded += parameter.numel() if dtensor is not None and isinstance(parameter, dtensor) else 0
    return sharded / max(total, 1)


def _profile_steps(step, first: int, count: int, path: Path, title: str) -> None:
    """`count` more steps under torch.profiler; the operators with the most device time, then the most host
    time, written to `path`."""
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    started = time.perf_counter()
    with profile(activities=activities) as prof:
        for index in range(count):
            step(first + index)
        if torch.cuda.is_available():
            torch.cuda.synchronize()
    wall = time.perf_counter() - started
    averages = prof.key_averages()
    # no summed device time: an operator's row and its kernels' rows both carry the same kernel time
    lines = [title, f"{count} steps, {1e3 * wall:.1f} ms of wall time (profiled)", ""]
    if torch.cuda.is_available():
        lines += [averages.table(sort_by="self_cuda_time_total", row_limit=30), ""]
    lines += [averages.table(sort_by="self_cpu_time_total", row_limit=30)]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")


def _run_variant(variant: str, accelerator, config, setup, strategy: str, batches: list[torch.Tensor],
                 warmup: int, repeats: int, checkpointing: bool, profile_dir: Optional[Path] = None,
                 ) -> dict[str, Any]:
    from bem.profiling.models import load_base_model
    from bem.training import distributed
    from bem.training.optim import fused_on_cuda, param_groups, trainable_parameters
    from train_setups import set_trainable_dtype

    device = accelerator.device
    base = load_base_model(replace(config.model, dtype="bfloat16"), device, config.seed)
    if checkpointing:
        from bem.training.model_factory import enable_gradient_checkpointing

        enable_gradient_checkpointing(base)
    model = _wrap(variant, base, config)
    del base
    set_trainable_dtype(model, setup.adapter_dtype)
    model.train()
    whole: list[torch.nn.Parameter] = []
    if strategy == "fsdp":
        distributed.shard_on_cpu(accelerator)  # a CPU run stays FSDP for every variant
        controller = getattr(model, "controller", None) if variant == "bem" else None
        if controller is not None:
            whole = distributed.keep_whole(accelerator, [controller])
        else:
            accelerator.state.fsdp_plugin.ignored_modules = None  # the last variant's choice does not carry over
    params = trainable_parameters(model)
    optimizer = torch.optim.AdamW(param_groups(params, whole), lr=config.train.learning_rate, **fused_on_cuda(params))
    model, optimizer = accelerator.prepare(model, optimizer)
    sharded = _sharded_fraction(model)

    losses: list[float] = []

    def step(index: int) -> None:
        ids = batches[index % len(batches)]
        with accelerator.autocast():
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
        accelerator.backward(loss)
        if whole:  # what FSDP leaves whole, it does not reduce either
            distributed.average_gradients(whole, accelerator.num_processes)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(float(loss.detach()))

    def sync() -> None:
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for index in range(warmup):
        step(index)
    sync()
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    times = []
    for index in range(repeats):
        sync()
        started = time.perf_counter()
        step(warmup + index)
        sync()
        times.append(time.perf_counter() - started)
    peak = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else -1
    if profile_dir is not None:  # every process steps (the collectives need all); process 0 writes
        path = Path(profile_dir) / f"{setup.name}_{strategy}_{variant}.txt"
        if accelerator.is_main_process:
            _profile_steps(step, warmup + repeats, 2, path, f"{variant}, {strategy}, {setup.name}, process 0")
        else:
            for index in range(2):
                step(warmup + repeats + index)
        sync()
    gathered = accelerator.gather(torch.tensor([times + [float(peak)]], device=device, dtype=torch.float64)).cpu()
    per_step = gathered[:, :-1].max(0).values.tolist()  # the slowest process sets each step's time
    peaks = [int(p) for p in gathered[:, -1].tolist()]
    processes = accelerator.num_processes
    tokens = batches[0].numel() * processes
    step_s = statistics.median(per_step)
    record = {
        "variant": variant, "strategy": strategy, "processes": processes, "setup": setup.name,
        "batch_per_process": batches[0].shape[0], "sequence": batches[0].shape[1], "repeats": repeats,
        "tokens_per_s": tokens / step_s, "tokens_per_s_per_process": tokens / step_s / processes,
        "step_ms": [1e3 * t for t in per_step],
        "peak_bytes_by_process": None if peaks[0] < 0 else peaks,
        "sharded_fraction": sharded, "losses": losses, "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
    }
    accelerator.free_memory(model, optimizer)
    del model, optimizer
    return record


def worker_main(args: argparse.Namespace, config) -> int:
    """Inside a launched process: both variants under `args.worker`'s strategy; process 0 writes the record."""
    from accelerate.utils import set_seed

    from bem.profiling.sweep import free_device_memory
    from bem.training import distributed
    from bem.training.schema import TrainingSection
    from train_setups import SETUPS

    setup = SETUPS[args.setups]
    device_name = args.device or config.device
    cpu = device_name == "cpu" or not torch.cuda.is_available()
    training = TrainingSection(mixed_precision="bf16" if setup.autocast else "no", cpu=cpu,
                               distributed="fsdp" if args.worker == "fsdp" else "ddp")
    accelerator = distributed.make_accelerator(training)
    rank = accelerator.process_index
    batch = args.batch_size or config.train.batch_size
    length = args.seq_len or config.train.sequence_length
    generator = torch.Generator().manual_seed(config.seed + 1000 * (rank + 1))  # each process its own data
    vocab = vocab_size_of(config)
    low = 3 if vocab > 3 else 0
    batches = [torch.randint(low, vocab, (batch, length), generator=generator).to(accelerator.device)
               for _ in range(3)]  # both variants train on the same batches
    rows = []
    for variant in VARIANTS:
        set_seed(config.seed)  # the same base and adapter initialisation on every process
        rows.append(_run_variant(variant, accelerator, config, setup, args.worker, batches,
                                 max(1, config.timing.warmup), args.repeats or 10, args.gradient_checkpointing,
                                 args.profile))
        free_device_memory()
    if accelerator.is_main_process and args.worker_out is not None:
        Path(args.worker_out).write_text(json.dumps({"rows": rows}))
    accelerator.wait_for_everyone()
    accelerator.end_training()
    return 0


def vocab_size_of(config) -> int:
    """The vocabulary of the config's model, without building it."""
    spec = config.model
    if spec.path is not None:
        from transformers import AutoConfig

        return int(AutoConfig.from_pretrained(spec.path, local_files_only=True).vocab_size)
    return int(spec.config["vocab_size"])
