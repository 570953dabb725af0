"""Where a wrapped linear's time goes when the host is the bound (short prompts, small and narrow models).

Part 1, one call (bf16, rank 8, 1024 rows, each config's linear shapes): `F.linear`, `nn.Linear`,
`BEMLinear` (its direct inference call, and its checked path), and the extension called with each prefill
composition (mode 3: the update kernel then cuBLAS; mode 6: the GEMM with the update inside). For each:
the host's time to issue a call (no sync, median of interleaved rounds) and the device's time (a CUDA
graph of the calls, replayed).

Part 2, a whole prefill (batch 1, 1024 tokens, the last position's logits, SDPA): the base, BEM, BEM
through the checked path, and BEM with mode 6 at prefill sizes, interleaved; host issue and wall time.

    PYTHONPATH=. python scripts/host_cost.py [--configs smollm_135m,gpt2,llama_1b] [--rank 8] [--calls-only]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import time
from typing import Callable

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers.pytorch_utils import Conv1D

from bem.kernels import custom_ops, ops
from bem.modules import bem_linear
from bem.modules.bem_linear import BEMLinear, RoutingContext

SHAPES = {  # (K, N) of the wrapped linears, one of each kind
    "smollm_135m": [(576, 576), (576, 192), (576, 1536), (1536, 576)],
    "gpt2": [(768, 2304), (768, 768), (768, 3072), (3072, 768)],
    "llama_1b": [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)],
    "qwen2_1.5b": [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536)],
    "phi3_mini": [(3072, 9216), (3072, 3072), (3072, 16384), (8192, 3072)],
}
ROWS, RANK = 1024, 8  # RANK: the default of --rank


def host_and_wall(fn: Callable[[], object], calls: int) -> tuple[float, float]:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    issued = time.perf_counter()
    torch.cuda.synchronize()
    return (issued - start) / calls * 1e6, (time.perf_counter() - start) / calls * 1e6


def graph_us(fn: Callable[[], object], calls: int = 10, replays: int = 20) -> float:
    fn()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(calls):
            fn()
    graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1e3 / (calls * replays)


class ForcedMode:
    """The extension with `linear_forward` asked for one composition above decode sizes."""

    def __init__(self, extension, mode: int) -> None:
        self._extension, self._mode = extension, mode

    def __getattr__(self, name: str):
        return getattr(self._extension, name)

    def linear_forward(self, x, weight, bias, V, codes, U, scaling, mode=0, *rest):
        if mode == 0 and x.numel() > 16 * x.shape[-1]:
            mode = self._mode
        return self._extension.linear_forward(x, weight, bias, V, codes, U, scaling, mode, *rest)


def old_forward(self: BEMLinear, x: torch.Tensor) -> torch.Tensor:
    """BEMLinear's forward before its direct call: every check in Python first."""
    context = self.context
    if not context.enabled:
        return self._modules["base_layer"](x)
    codes = None if context.codes is None else context.codes[self.module_index]
    return bem_linear._forward_checked(self, self.spec, x, codes)


def per_call_rows(names: list[str], rank: int) -> list[dict]:
    ext = custom_ops.extension()
    rows = []
    for name in names:
        for K, N in SHAPES[name]:
            conv = name == "gpt2"
            base = (Conv1D(N, K) if conv else nn.Linear(K, N)).to("cuda", torch.bfloat16)
            nn.init.normal_(base.weight, std=K ** -0.5)
            context = RoutingContext()
            layer = BEMLinear(base, rank, 16.0, 0.0, 0, context).eval()
            nn.init.normal_(layer.bem_U, std=0.02)
            x = torch.randn(1, ROWS, K, device="cuda", dtype=torch.bfloat16)
            context.set_codes(torch.randn(1, 1, ROWS, rank, device="cuda", dtype=torch.bfloat16))
            codes = context.codes[0]
            W = base.weight.t() if conv else base.weight
            b, V, U = base.bias, layer.bem_V, layer.bem_U
            Vt = V.t().contiguous()
            variants = {
                "F.linear": lambda: F.linear(x, W, b),
                "nn module (base)": lambda: base(x),
                "BEMLinear": lambda: layer(x),
                "BEMLinear checked": lambda: old_forward(layer, x),
                "ext mode 0": lambda: ext.linear_forward(x, W, b, V, codes, U, 2.0, 0, 0, False, Vt),
                "ext mode 3": lambda: ext.linear_forward(x, W, b, V, codes, U, 2.0, 3, 0, False, Vt),
                "ext mode 6": lambda: ext.linear_forward(x, W, b, V, codes, U, 2.0, 6, 0, False, Vt),
            }
            samples: dict[str, list] = {k: [] for k in variants}
            with torch.inference_mode():
                for fn in variants.values():
                    host_and_wall(fn, 20)
                for _ in range(7):
                    for key, fn in variants.items():
                        samples[key].append(host_and_wall(fn, 100))
                for key, fn in variants.items():
                    host = statistics.median(s[0] for s in samples[key])
                    spread = (min(s[0] for s in samples[key]), max(s[0] for s in samples[key]))
                    wall = statistics.median(s[1] for s in samples[key])
                    try:
                        device = graph_us(fn)
                    except Exception as err:  # noqa: BLE001 - a row says why it has no device time
                        device = float("nan")
                        print(f"  {name} {K}x{N} {key}: no graph ({type(err).__name__}: {err})")
                    rows.append({"config": name, "K": K, "N": N, "variant": key, "host_us": host,
                                 "host_min": spread[0], "host_max": spread[1], "wall_us": wall, "device_us": device})
    return rows


def prefill_rows(names: list[str], repeats: int) -> list[dict]:
    from bem.profiling.config import load_profile_config
    from bem.profiling.models import load_base_model
    from bem import create_hierarchical_bem

    rows = []
    for name in names:
        config = load_profile_config(f"configs/profile_{name}.yaml")
        base = load_base_model(config.model, torch.device("cuda"), config.seed)
        bem = create_hierarchical_bem(copy.deepcopy(base), config.bem_config()).eval()
        linears = sum(isinstance(m, BEMLinear) for m in bem.modules())
        ids = torch.randint(3, config.model.config.get("vocab_size", 32000), (1, ROWS), device="cuda")
        mask = torch.ones_like(ids)

        def run(model):
            return lambda: model(input_ids=ids, attention_mask=mask, use_cache=True, logits_to_keep=1)

        real = custom_ops._C
        forced = ForcedMode(real, 6)
        direct = BEMLinear.forward

        def with_state(fn, extension=real, forward=direct):
            def call():
                custom_ops._C, BEMLinear.forward = extension, forward
                try:
                    return fn()
                finally:
                    custom_ops._C, BEMLinear.forward = real, direct
            return call

        variants = {
            "base": run(base),
            "bem": run(bem),
            "bem checked path": with_state(run(bem), forward=old_forward),
            "bem mode 6": with_state(run(bem), extension=forced),
        }
        samples: dict[str, list] = {k: [] for k in variants}
        with torch.inference_mode():
            for _ in range(3):
                for fn in variants.values():
                    host_and_wall(fn, 1)
            for _ in range(repeats):
                for key, fn in variants.items():
                    samples[key].append(host_and_wall(fn, 1))
            hidden = bem.get_input_embeddings()(ids)
            controller = bem.controller
            control = [host_and_wall(lambda: controller(hidden, mask, None, out_dtype=torch.bfloat16,
                                                        return_state=True), 1) for _ in range(repeats)]
        base_wall = [s[1] for s in samples["base"]]
        for key, values in samples.items():
            walls = [s[1] for s in values]
            ratios = sorted(w / b for w, b in zip(walls, base_wall))
            rows.append({"config": name, "variant": key, "linears": linears,
                         "host_ms": statistics.median(s[0] for s in values) / 1e3,
                         "wall_ms": statistics.median(walls) / 1e3,
                         "over_base": statistics.median(ratios) - 1,
                         "over_base_p10": ratios[len(ratios) // 10] - 1,
                         "over_base_p90": ratios[(len(ratios) * 9) // 10] - 1})
        rows.append({"config": name, "variant": "controller alone", "linears": linears,
                     "host_ms": statistics.median(s[0] for s in control) / 1e3,
                     "wall_ms": statistics.median(s[1] for s in control) / 1e3})
        del base, bem
        torch.cuda.empty_cache()
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--configs", default="smollm_135m,gpt2,llama_1b")
    parser.add_argument("--calls-only", action="store_true")
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--rank", type=int, default=RANK, help="of the one-call rows (the models use their config's)")
    parser.add_argument("--json")
    args = parser.parse_args()
    names = args.configs.split(",")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + 1.0
    while time.perf_counter() < end:
        a @ a
    print(f"{torch.cuda.get_device_name()}, torch {torch.__version__}")
    calls = per_call_rows(names, args.rank)
    print(f"\none call, bf16, {ROWS} rows, rank {args.rank}: host issue us (median [min, max] of 7 rounds of 100), "
          "device us (CUDA graph)")
    for r in calls:
        print(f"  {r['config']:12s} {r['K']:5d}x{r['N']:<5d} {r['variant']:18s} host {r['host_us']:6.2f} "
              f"[{r['host_min']:6.2f}, {r['host_max']:6.2f}]  wall {r['wall_us']:7.2f}  device {r['device_us']:7.2f}")
    prefill = [] if args.calls_only else prefill_rows(names, args.repeats)
    if prefill:
        print(f"\nprefill b1 s{ROWS}, logits_to_keep=1 (median of {args.repeats} interleaved; ratio interval p10-p90)")
        for r in prefill:
            extra = (f"  over base {r['over_base']:+.1%} [{r['over_base_p10']:+.1%}, {r['over_base_p90']:+.1%}]"
                     if "over_base" in r else "")
            print(f"  {r['config']:12s} {r['variant']:18s} host {r['host_ms']:7.3f} ms  wall {r['wall_ms']:7.3f} ms"
                  f"{extra}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"device": torch.cuda.get_device_name(), "calls": calls, "prefill": prefill}, handle, indent=1)


if __name__ == "__main__":
    main()
