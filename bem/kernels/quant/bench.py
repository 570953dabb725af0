"""The 4-bit linear with BEM's update at decode sizes (python -m bem.kernels.bench --quant4): the fused kernel
against bitsandbytes' own 4-bit layer (the frozen base), that layer with BEM's update beside it (the path without the
kernel), the same layer with PEFT's LoRA update (QLoRA), and the bfloat16 linear, NF4 with double quantization,
bf16 compute, rank 8.

Two numbers per variant: device time (the calls captured in one CUDA graph and replayed, as a compiled decoding step
runs them) and eager time per call (what an eager decoding step pays, host included), each the median of
interleaved rounds, with the rounds' spread for the eager one (host-bound, so noisy)."""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import torch

from .. import bench as common
from .. import ops as lowrank_ops
from . import ops

# (K, N): Qwen2-0.5B's q/o, gate/up and down; Llama-3-8B's q/o, gate/up and down
SHAPES = [(896, 896), (896, 4864), (4864, 896), (4096, 4096), (4096, 14336), (14336, 4096)]
TOKENS = (1, 4, 16)
RANK = 8


def _layer(K: int, N: int) -> torch.nn.Module:
    import bitsandbytes as bnb

    layer = bnb.nn.Linear4bit(K, N, bias=False, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True)
    layer.weight = bnb.nn.Params4bit(torch.randn(N, K, dtype=torch.bfloat16) / K**0.5, requires_grad=False,
                                     quant_type="nf4", compress_statistics=True)
    return layer.cuda()


def _variants(M: int, K: int, N: int) -> dict[str, Callable[[], object]]:
    layer = _layer(K, N)
    g = torch.Generator(device="cuda").manual_seed(M * 7 + K)
    x = torch.randn(M, K, device="cuda", generator=g, dtype=torch.bfloat16)
    V = torch.randn(K, RANK, device="cuda", generator=g, dtype=torch.bfloat16) / K**0.5
    U = torch.randn(N, RANK, device="cuda", generator=g, dtype=torch.bfloat16) * 0.1
    codes = torch.rand(M, RANK, device="cuda", generator=g, dtype=torch.bfloat16)
    A, B = V.t().contiguous(), U.contiguous()  # LoRA's A (r x K) and B (N x r)
    W = torch.randn(N, K, device="cuda", generator=g, dtype=torch.bfloat16)
    return {
        "bf16 linear": lambda: torch.nn.functional.linear(x, W),
        "4-bit base": lambda: layer(x),
        "base + update": lambda: layer(x) + lowrank_ops.generated_update(x, V, codes, U, 2.0, True),
        "QLoRA": lambda: layer(x) + torch.nn.functional.linear(torch.nn.functional.linear(x, A), B) * 2.0,
        "BEM fused": lambda: ops.kernel_call(ops.kept_weight(layer), x, None, V, codes, U, 2.0),
    }


def _eager_us(fn: Callable[[], object], calls: int = 200) -> float:
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / calls * 1e6


def _device_us(fn: Callable[[], object], calls: int = 20) -> float:
    try:
        replay = common._graph(lambda _: fn(), calls)
    except RuntimeError:  # a variant that cannot be captured
        return float("nan")
    return common._median_ms(replay) / calls * 1e3


def bench(M: int, K: int, N: int, rounds: int = 5) -> dict:
    variants = _variants(M, K, N)
    with torch.no_grad():
        for fn in variants.values():
            fn()
        eager: dict[str, list[float]] = {name: [] for name in variants}
        for _ in range(rounds):
            for name, fn in variants.items():
                eager[name].append(_eager_us(fn))
        device = {name: _device_us(fn) for name, fn in variants.items()}
    return {"M": M, "K": K, "N": N, "r": RANK, "device_us": device,
            "eager_us": {name: sorted(v)[len(v) // 2] for name, v in eager.items()},
            "eager_range_us": {name: (min(v), max(v)) for name, v in eager.items()}}


def format_table(results: list[dict]) -> str:
    names = list(results[0]["device_us"])
    lines = ["device µs a call (CUDA graph) | eager µs a call (median [min, max] of rounds); BEM fused over the "
             "4-bit base and over QLoRA",
             "| M | K | N | " + " | ".join(names) + " | fused / base | fused / QLoRA |",
             "|" + "---|" * (len(names) + 5)]
    for res in results:
        d, e, rng = res["device_us"], res["eager_us"], res["eager_range_us"]
        cells = [f"{d[n]:.1f} / {e[n]:.1f} [{rng[n][0]:.0f}, {rng[n][1]:.0f}]" for n in names]
        ratio = lambda a, b: f"x{d[a] / d[b]:.2f} / x{e[a] / e[b]:.2f}"  # noqa: E731
        lines.append(f"| {res['M']} | {res['K']} | {res['N']} | " + " | ".join(cells)
                     + f" | {ratio('BEM fused', '4-bit base')} | {ratio('BEM fused', 'QLoRA')} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="two shapes")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not lowrank_ops.KERNELS_AVAILABLE:
        raise SystemExit("the benchmark needs a CUDA GPU and the BEM extension (bem.kernels.KERNELS_AVAILABLE)")
    common.warm_up()
    shapes = SHAPES[:1] + SHAPES[3:4] if args.quick else SHAPES
    results = [bench(M, K, N) for K, N in shapes for M in TOKENS]
    print(f"{torch.cuda.get_device_name()}, bf16, NF4 with double quantization, r = {RANK}")
    print(format_table(results))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
