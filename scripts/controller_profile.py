"""The routing controller alone, at each profile config's shapes (CUDA): its whole-sequence call eagerly and
replayed from its CUDA graph (inference), and a training forward+backward, with the kernels of one eager
call by device time. With --before FILE (an earlier bem/modules/controller.py), the same for that version,
interleaved in the same process, with the same weights.

    python scripts/controller_profile.py [--configs gpt2 qwen2_1.5b] [--before old_controller.py] [--json F]
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch
from torch.profiler import ProfilerActivity, profile

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bem import create_hierarchical_bem  # noqa: E402
from bem.profiling.config import load_profile_config  # noqa: E402
from bem.profiling.models import load_base_model  # noqa: E402


def controller_kwargs(controller) -> dict:
    return dict(hidden_size=controller.hidden_size, num_modules=controller.num_modules, rank=controller.rank,
                token_module_indices=controller.token_module_indices.tolist(),
                controller_dim=controller.input_proj.out_features, chunk_size=controller.chunk_size,
                max_prefix_tokens=controller.max_prefix_tokens, ema_decay=controller.ema_decay,
                code_clamp_value=controller.code_clamp_value, enable_uncertainty=controller.gate is not None,
                enable_token_routing=controller.token_head is not None, side_signal_dim=controller.side_signal_dim)


def load_before(path: Path):
    spec = importlib.util.spec_from_file_location("bem.modules.controller_before", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


def median_ms(fn, repeats: int = 25) -> tuple[float, float]:
    """(median, spread = max - min of the middle half) of the synchronised time of fn, in ms."""
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    middle = times[len(times) // 4: len(times) - len(times) // 4]
    return statistics.median(times), middle[-1] - middle[0]


def kernels(fn, top: int) -> tuple[int, float, list[tuple[str, float, int]]]:
    """(kernel launches, summed kernel ms, top kernels (name, ms, count)) of one call of fn."""
    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn()
        torch.cuda.synchronize()
    rows = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA]
    total = sum(e.device_time_total for e in rows) / 1e3
    count = sum(e.count for e in rows)
    rows.sort(key=lambda e: -e.device_time_total)
    return count, total, [(e.key[:70], e.device_time_total / 1e3, e.count) for e in rows[:top]]


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--configs", nargs="*", default=["gpt2", "qwen2_1.5b", "smollm_135m", "llama_1b", "phi3_mini"])
    parser.add_argument("--before", type=Path, default=None)
    parser.add_argument("--top", type=int, default=12)
    parser.add_argument("--json", type=Path, default=None)
    args = parser.parse_args()
    device = torch.device("cuda")
    before = load_before(args.before) if args.before else None
    results = []
    for name in args.configs:
        config = load_profile_config(REPO / "configs" / f"profile_{name}.yaml")
        base = load_base_model(config.model, device, config.seed)
        model = create_hierarchical_bem(base, config.bem_config()).eval()
        variants = {"now": model.controller}
        if before is not None:
            old = before.HierarchicalController(**controller_kwargs(model.controller)).to(device).eval()
            if not hasattr(old, "stacked"):  # today's graph cache enters the stacked weights' capture scope
                from bem.modules.controller_heads import StackedWeights
                old.stacked = StackedWeights()
            old.load_state_dict(model.controller.state_dict())
            variants = {"before": old, **variants}
        H = model.controller.hidden_size
        shapes = [("prefill", b, s) for b, s in config.prefill.shapes]
        if config.train.enabled:
            shapes.append(("train", config.train.batch_size, config.train.sequence_length))
        for kind, B, T in shapes:
            hidden = torch.randn(B, T, H, device=device, dtype=torch.bfloat16)
            mask = torch.ones(B, T, device=device, dtype=torch.long)
            row = {"config": name, "kind": kind, "batch": B, "tokens": T,
                   "code_values": B * T * model.controller.num_modules * model.controller.rank}
            calls = {}
            for label, controller in variants.items():
                if kind == "train":
                    controller.train()

                    def step(c=controller):
                        h = hidden.detach().requires_grad_(True)
                        out = c(h, mask, None, out_dtype=torch.bfloat16)
                        out.codes.float().square().mean().backward()
                    calls[f"{label} train fwd+bwd"] = step
                else:
                    controller.eval()

                    def eager(c=controller):
                        with torch.inference_mode():
                            c.forward_math(hidden, mask, None, torch.bfloat16, True)

                    def replayed(c=controller):
                        with torch.inference_mode():
                            c(hidden, mask, None, out_dtype=torch.bfloat16, return_state=True)
                    calls[f"{label} eager"] = eager
                    calls[f"{label} call"] = replayed  # replayed from a graph where the size allows
            row["graph_mib"] = {}
            for label, fn in calls.items():  # the first two calls capture the graph where the size allows
                if label.endswith("call"):
                    torch.cuda.synchronize()
                    before_capture = torch.cuda.memory_allocated()
                    fn(), fn()
                    torch.cuda.synchronize()
                    row["graph_mib"][label] = (torch.cuda.memory_allocated() - before_capture) / 2**20
            timings = {label: [] for label in calls}
            for _ in range(3):  # interleaved rounds
                for label, fn in calls.items():
                    timings[label].append(median_ms(fn))
            row["ms"] = {label: min(t[0] for t in values) for label, values in timings.items()}
            row["spread_ms"] = {label: max(t[1] for t in values) for label, values in timings.items()}
            row["kernels"] = {}
            for label, fn in calls.items():
                if label.endswith("call"):
                    continue
                count, total, top = kernels(fn, args.top)
                row["kernels"][label] = {"launches": count, "kernel_ms": total, "top": top}
            for c in variants.values():
                c.eval()
            results.append(row)
            print(f"\n== {name} {kind} b{B} s{T} ({row['code_values'] / 1e6:.1f}M code values)")
            for label in calls:
                extra = row["kernels"].get(label)
                extra = f"  {extra['launches']:4d} kernels, {extra['kernel_ms']:.3f} ms summed" if extra else ""
                if label in row["graph_mib"]:
                    extra = f"  graph memory {row['graph_mib'][label]:.1f} MiB"
                print(f"  {label:24s} {row['ms'][label]:8.3f} ms (spread {row['spread_ms'][label]:.3f}){extra}")
            for label, info in row["kernels"].items():
                print(f"  -- {label}: top kernels")
                for kname, ms, count in info["top"]:
                    print(f"     {ms:7.3f} ms {count:4d}x  {kname}")
        del model, base, variants
        torch.cuda.empty_cache()
    print("\nms per call (median; 'call' is replayed from a CUDA graph where the size allows):")
    for row in results:
        print(f"{row['config']:13s} {row['kind']:8s} b{row['batch']} s{row['tokens']:<6d} "
              + "  ".join(f"{label} {value:.3f}" for label, value in row["ms"].items()))
    if args.json:
        args.json.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
