"""Where a training step's time goes: BEM against PEFT LoRA on one profile config, one setup.

    python scripts/train_breakdown.py --config configs/profile_smollm_135m.yaml --setup bf16

Per variant: each step's synchronised wall time and the host's time to issue it (forward, backward,
optimizer) over --steps steps, interleaved with the other variants; then a profiler trace of three steps:
the device's busy time per step, host-device synchronisations, and the top kernels and ops by device time.
The frozen base is timed beside them as the profiler's training setting times it (forward and backward to the
input embeddings, no optimizer). The optimizer is AdamW, fused on CUDA as `bem.training.optim` and transformers'
Trainer make it. `--sample`: also the host's Python stacks over --steps more steps per variant
(scripts/stack_sampler.py). `--gradient-checkpointing`, `--batch-size` and `--seq-len` as in
benchmarks/train_throughput.py."""

from __future__ import annotations

import argparse
import statistics
import sys
import time
from dataclasses import replace
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "benchmarks", ROOT / "scripts"):
    sys.path.insert(0, str(folder))

from train_setups import SETUPS, set_trainable_dtype  # noqa: E402

from bem.kernels import custom_ops  # noqa: E402
from bem.profiling.config import load_profile_config  # noqa: E402
from bem.profiling.models import build_variants, load_base_model, vocab_size  # noqa: E402
from bem.profiling.timing import warm_up_gpu  # noqa: E402
from bem.training.optim import fused_on_cuda  # noqa: E402
from stack_sampler import StackSampler  # noqa: E402


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", type=Path, required=True)
    parser.add_argument("--setup", choices=sorted(SETUPS), default="bf16")
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--gradient-checkpointing", action="store_true")
    parser.add_argument("--top", type=int, default=18)
    parser.add_argument("--sample", action="store_true", help="also sample the host's Python stacks")
    parser.add_argument("--composed", action="store_true",
                        help="also time BEM with the prefill backward's low-rank pieces composed (cuBLAS)")
    return parser.parse_args()


def make_step(model, ids, setup, lr, frozen_base=False):
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = None if frozen_base else torch.optim.AdamW(params, lr=lr, **fused_on_cuda(params))
    mask = torch.ones_like(ids)
    embeddings = model.get_input_embeddings()

    def step() -> tuple[float, float, float]:
        """(forward issue ms, backward issue ms, optimizer issue ms): host time, no sync inside."""
        t0 = time.perf_counter()
        with torch.autocast("cuda", dtype=torch.bfloat16, enabled=setup.autocast):
            if frozen_base:
                embeds = embeddings(ids).detach().requires_grad_(True)
                loss = model(inputs_embeds=embeds, attention_mask=mask, labels=ids, use_cache=False).loss
            else:
                loss = model(input_ids=ids, attention_mask=mask, labels=ids, use_cache=False).loss
        t1 = time.perf_counter()
        loss.backward()
        t2 = time.perf_counter()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
        t3 = time.perf_counter()
        return (t1 - t0) * 1e3, (t2 - t1) * 1e3, (t3 - t2) * 1e3

    return step


def timed(step) -> tuple[float, tuple[float, float, float]]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    issue = step()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) * 1e3, issue


def trace(step, top: int, label: str) -> None:
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(3):
            step()
        torch.cuda.synchronize()
    events = prof.key_averages()
    kernels = [e for e in events if e.device_type == torch.autograd.DeviceType.CUDA]
    busy = sum(e.self_device_time_total for e in kernels) / 3 / 1e3
    syncs = {e.key: e.count // 3 for e in events
             if e.key in ("cudaStreamSynchronize", "cudaDeviceSynchronize", "cudaMemcpyAsync", "cudaEventSynchronize",
                          "aten::item", "aten::_local_scalar_dense", "cudaMalloc", "cudaFree")}
    launches = sum(e.count for e in events if e.key in ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel",
                                                        "cuLaunchKernelEx")) // 3
    print(f"  [{label}] device busy {busy:.2f} ms/step, {launches} launches/step, per step: {syncs}")
    print(f"  [{label}] top kernels by device time (ms/step, calls/step):")
    for e in sorted(kernels, key=lambda e: -e.self_device_time_total)[:top]:
        print(f"     {e.self_device_time_total / 3 / 1e3:8.3f}  {e.count // 3:5d}  {e.key[:110]}")
    ops = [e for e in events if e.device_type == torch.autograd.DeviceType.CPU and e.key.startswith(("bem", "aten"))]
    print(f"  [{label}] top host ops by self CPU time (ms/step, calls/step):")
    for e in sorted(ops, key=lambda e: -e.self_cpu_time_total)[:top]:
        print(f"     {e.self_cpu_time_total / 3 / 1e3:8.3f}  {e.count // 3:5d}  {e.key[:110]}")


def main() -> None:
    args = parse_args()
    config = load_profile_config(args.config)
    setup = SETUPS[args.setup]
    device = torch.device("cuda")
    warm_up_gpu(device, 2.0)
    base = load_base_model(replace(config.model, dtype="bfloat16"), device, config.seed)
    if args.gradient_checkpointing:
        from bem.training.model_factory import enable_gradient_checkpointing

        enable_gradient_checkpointing(base)
    batch = args.batch_size or config.train.batch_size
    length = args.seq_len or config.train.sequence_length
    ids = torch.randint(3, vocab_size(base), (batch, length), device=device)
    variants = build_variants(base, config.bem_config(), with_lora=True)
    models = {"base": base, "bem": variants.bem, "lora": variants.lora}
    steps = {}
    for name, model in models.items():
        set_trainable_dtype(model, setup.adapter_dtype)
        model.train()
        steps[name] = make_step(model, ids, setup, config.train.learning_rate, frozen_base=name == "base")
    if args.composed:  # the same model and optimizer state, its backward's low-rank pieces through cuBLAS
        fused_step = steps["bem"]

        def composed_step():
            with custom_ops.prefill_grads_path("composed"):
                return fused_step()

        steps["bem_composed"] = composed_step
    for _ in range(3):
        for step in steps.values():
            timed(step)
    results = {name: [] for name in steps}
    for _ in range(args.steps):
        for name, step in steps.items():
            results[name].append(timed(step))
    print(f"{config.name} {setup.name} b{batch} s{length}{' checkpointing' if args.gradient_checkpointing else ''} "
          f"on {torch.cuda.get_device_name()}")
    for name, rows in results.items():
        walls = [w for w, _ in rows]
        issue = [statistics.median(i[k] for _, i in rows) for k in range(3)]
        print(f"  {name:12s} wall ms: median {statistics.median(walls):7.2f}  min {min(walls):7.2f}  "
              f"max {max(walls):7.2f}  all {[round(w, 1) for w in walls]}")
        print(f"  {name:12s} host issue ms (median): forward {issue[0]:.2f}  backward {issue[1]:.2f}  "
              f"optimizer {issue[2]:.2f}")
    for name, step in steps.items():
        trace(step, args.top, name)
    if args.sample:
        for name, step in steps.items():
            with StackSampler() as sampler:
                for _ in range(args.steps):
                    step()
                torch.cuda.synchronize()
            sampler.report(args.top, name)


if __name__ == "__main__":
    main()
