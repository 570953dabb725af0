"""Training throughput: BEM (reference path and fused kernels) against PEFT LoRA, in one process.

    python benchmarks/train_throughput.py --config configs/train_llama_1b.yaml
    python benchmarks/train_throughput.py --config configs/train_llama_1b.yaml --tiny   # CPU smoke run

One randomly initialised base model from the config's `model` section is wrapped in turn by each
variant (same rank, alpha and target modules), trained for a few warm-up and timed steps on random
tokens, and unwrapped again. Variants are interleaved over `--rounds` rounds; the table shows the
median step's tokens/s and the peak memory of each, with ratios to PEFT LoRA.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable, Optional

import torch

HERE = Path(__file__).resolve().parent
for folder in (HERE.parent, HERE):  # the bem package and the sibling helper, when run as a script
    if str(folder) not in sys.path:
        sys.path.insert(0, str(folder))

from train_common import TARGETS, lora_config, variant_rows  # noqa: E402  (benchmarks/train_common.py)

from bem import HierarchicalBEMConfig, create_hierarchical_bem  # noqa: E402
from bem.training import load_train_config  # noqa: E402
from bem.training.model_factory import build_base_model, enable_gradient_checkpointing  # noqa: E402


@dataclass
class Measurement:
    name: str
    step_seconds: list[float] = field(default_factory=list)
    peak_bytes: int = 0
    trainable: int = 0
    note: str = ""


def parse_args(argv: Optional[list[str]] = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True, help="training config (model, bem, data.max_length, training)")
    parser.add_argument("--tiny", action="store_true", help="a tiny model, short sequences, float32: a CPU smoke run")
    parser.add_argument("--steps", type=int, default=10, help="timed steps per variant and round (default 10)")
    parser.add_argument("--warmup", type=int, default=3, help="untimed steps per variant and round (default 3)")
    parser.add_argument("--rounds", type=int, default=2, help="interleaved rounds over the variants (default 2)")
    parser.add_argument("--batch-size", type=int, default=None, help="default: training.batch_size")
    parser.add_argument("--seq-len", type=int, default=None, help="default: data.max_length")
    parser.add_argument("--device", default=None, help="default: cuda if available, else cpu")
    parser.add_argument("--json", type=Path, default=None, help="also write the results here")
    return parser.parse_args(argv)


def setup(args: argparse.Namespace):
    overrides = ["model.size=tiny", "model.dtype=float32", "training.mixed_precision=no"] if args.tiny else []
    config = load_train_config(args.config, overrides, check_paths=False)
    if config.model.path is None and config.model.architecture != "llama":
        raise SystemExit("this benchmark targets Llama-style models (its 7 projections); set model.architecture: llama")
    batch = args.batch_size or (2 if args.tiny else config.training.batch_size)
    seq = args.seq_len or (64 if args.tiny else config.data.max_length)
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    return config, batch, seq, device


def warm_up_device(device: torch.device) -> float:
    """A second of bf16 matmuls (clocks up), returning the achieved TFLOP/s as a ceiling to quote."""
    if device.type != "cuda":
        return float("nan")
    a = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    b = torch.randn(8192, 8192, device=device, dtype=torch.bfloat16)
    start, count = time.perf_counter(), 0
    while time.perf_counter() - start < 1.0:
        a @ b
        count += 1
        torch.cuda.synchronize(device)
    begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    begin.record()
    for _ in range(10):
        a @ b
    end.record()
    torch.cuda.synchronize(device)
    return 10 * 2 * 8192 ** 3 / (begin.elapsed_time(end) / 1e3) / 1e12


class StepTimer:
    """Per-step wall time: CUDA events on a GPU, perf_counter elsewhere."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def __call__(self, step: Callable[[], None]) -> float:
        if self.device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            begin.record()
            step()
            end.record()
            torch.cuda.synchronize(self.device)
            return begin.elapsed_time(end) / 1e3
        start = time.perf_counter()
        step()
        return time.perf_counter() - start


def wrap(name: str, base: torch.nn.Module, config, bem_kwargs: dict):
    """(model, unwrap) for one variant; the adapters are fp32 under autocast, as `bem train` keeps them."""
    if name == "PEFT LoRA":
        from peft import get_peft_model

        model = get_peft_model(base, lora_config(config.bem))
        unwrap = model.unload
    else:
        bem_config = HierarchicalBEMConfig.from_dict({**config.bem.to_dict(), **bem_kwargs, "target_modules": TARGETS,
                                                      "base_model_name_or_path": None})
        model = create_hierarchical_bem(base, bem_config)
        unwrap = model.unload
    if config.training.mixed_precision != "no":
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.float()
    return model, unwrap


def measure(name: str, base, config, bem_kwargs: dict, batches: list[torch.Tensor], args, device,
            result: Measurement) -> None:
    model, unwrap = wrap(name, base, config, bem_kwargs)
    params = [p for p in model.parameters() if p.requires_grad]
    result.trainable = sum(p.numel() for p in params)
    optimizer = torch.optim.AdamW(params, lr=1e-4)
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(config.training.mixed_precision)
    state = {"index": 0}

    def step() -> None:
        ids = batches[state["index"] % len(batches)]
        state["index"] += 1
        with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    timer = StepTimer(device)
    for _ in range(args.warmup):
        timer(step)
    result.step_seconds += [timer(step) for _ in range(args.steps)]
    if device.type == "cuda":
        result.peak_bytes = max(result.peak_bytes, torch.cuda.max_memory_allocated(device))
    if name != "PEFT LoRA" and bem_kwargs.get("use_fused_kernels"):
        result.note = fused_note(model, batches[0], device, dtype)
    del optimizer, params
    unwrap()
    del model
    gc.collect()
    if device.type == "cuda":
        torch.cuda.empty_cache()


def fused_note(model, ids: torch.Tensor, device: torch.device, dtype) -> str:
    from bem.kernels import fused_unavailable_reason

    layer = model.bem_modules()[0][1]
    x = torch.zeros(1, layer.in_features, device=device, dtype=dtype or layer.bem_V.dtype)
    with torch.autocast(device.type, dtype=dtype, enabled=dtype is not None):
        reason = fused_unavailable_reason(x, layer.bem_V, True, layer.base_layer.weight)
    return "" if reason is None else f"reference path ran: {reason}"


def main(argv: Optional[list[str]] = None) -> int:
    args = parse_args(argv)
    config, batch, seq, device = setup(args)
    torch.manual_seed(0)
    ceiling = warm_up_device(device)
    base = build_base_model(config.model, vocab_size=0, device=device)
    if config.training.gradient_checkpointing:
        enable_gradient_checkpointing(base)
    base.config.use_cache = False
    base.train()
    vocab = base.config.vocab_size
    batches = [torch.randint(0, vocab, (batch, seq), device=device) for _ in range(4)]
    variants = variant_rows()
    results = {name: Measurement(name) for name, _ in variants}
    for _ in range(args.rounds):
        for name, bem_kwargs in variants:
            measure(name, base, config, bem_kwargs, batches, args, device, results[name])
    rows = summarise(results, batch * seq)
    print_table(rows, config, batch, seq, device, ceiling)
    if args.json is not None:
        args.json.write_text(json.dumps({"batch": batch, "seq_len": seq, "device": str(device),
                                         "matmul_tflops": ceiling, "rows": rows,
                                         "raw": [asdict(m) for m in results.values()]}, indent=2))
    return 0


def summarise(results: dict[str, Measurement], tokens_per_step: int) -> list[dict]:
    lora = results["PEFT LoRA"]
    lora_tps = tokens_per_step / statistics.median(lora.step_seconds)
    rows = []
    for m in results.values():
        tps = tokens_per_step / statistics.median(m.step_seconds)
        rows.append({"variant": m.name, "tokens_per_s": tps, "speed_vs_lora": tps / lora_tps,
                     "peak_gib": m.peak_bytes / 2 ** 30 if m.peak_bytes else None,
                     "memory_vs_lora": m.peak_bytes / lora.peak_bytes if lora.peak_bytes else None,
                     "trainable_params": m.trainable, "note": m.note})
    return rows


def print_table(rows: list[dict], config, batch: int, seq: int, device: torch.device, ceiling: float) -> None:
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}; batch {batch} x seq {seq}; {config.model.dtype}, mixed precision "
          f"{config.training.mixed_precision}, gradient checkpointing {config.training.gradient_checkpointing}; "
          f"rank {config.bem.rank}, targets {', '.join(TARGETS)}")
    if ceiling == ceiling:
        print(f"bf16 matmul ceiling (8192^3): {ceiling:.0f} TFLOP/s")
    header = f"{'variant':<24}{'tokens/s':>12}{'x LoRA':>9}{'peak GiB':>10}{'x LoRA':>9}{'trainable':>12}  note"
    print(header)
    print("-" * len(header))
    for row in rows:
        peak = "n/a" if row["peak_gib"] is None else f"{row['peak_gib']:.2f}"
        mem_ratio = "n/a" if row["memory_vs_lora"] is None else f"{row['memory_vs_lora']:.3f}"
        print(f"{row['variant']:<24}{row['tokens_per_s']:>12.0f}{row['speed_vs_lora']:>9.3f}{peak:>10}"
              f"{mem_ratio:>9}{row['trainable_params']:>12,d}  {row['note']}")


if __name__ == "__main__":
    sys.exit(main())
