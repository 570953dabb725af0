"""Benchmark of the BEM linear: `python -m bem.kernels.bench [--quick] [--json FILE]`
(`--fftconv` and `--mlstm` run the sequence mixers' kernel benchmarks instead, `--quant4` the 4-bit linear's).

For each shape, in one process and interleaved: plain `F.linear`, the PEFT-style LoRA pattern
(`F.linear(x, W, b) + (x A^T) B^T * s`), the BEM reference path, and the fused kernels (the default
dispatch and each composition mode), forward and forward+backward, plus the update alone. Every
variant is captured in a CUDA graph that cycles through several input sets (more bytes than L2) and
timed by its replays (median of CUDA-event timings), so the numbers are GPU time, not Python time.
Ceilings measured in the same run: a large device-to-device copy (bytes read + written) and a large
bf16 matmul. Ratios are to `F.linear` of the same shape.
"""

from __future__ import annotations

import argparse
import json
import math
from typing import Callable

import torch
import torch.nn.functional as F

from . import custom_ops, ops, reference

DTYPE = torch.bfloat16
SQUARE = (4096, 4096)
SHAPES_FULL = (
    [(m, *SQUARE, r) for m in (1, 16, 512, 4096, 16384) for r in (8, 16, 32, 64)]
    + [(m, k, n, r) for m in (1, 16, 4096, 16384) for (k, n) in ((4096, 14336), (14336, 4096)) for r in (8, 32)]
    + [(16384, 768, 768, r) for r in (8, 32)]
)
SHAPES_QUICK = [(1, 4096, 4096, 8), (16, 4096, 4096, 8), (4096, 4096, 4096, 8), (16384, 4096, 4096, 8),
                (16384, 768, 768, 8)]


def _median_ms(fn: Callable[[], None]) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=100, return_mode="median")


def _graph(fn: Callable[[int], object], calls: int) -> Callable[[], None]:
    """Capture `calls` invocations fn(0..calls-1) in one CUDA graph; returns its replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for i in range(calls):
            fn(i)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for i in range(calls):
            fn(i)
    return graph.replay


def warm_up(seconds: float = 1.0) -> None:
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    while True:
        for _ in range(10):
            a @ a
        end.record()
        end.synchronize()
        if start.elapsed_time(end) > seconds * 1e3:
            return


def ceilings() -> dict:
    n = 1 << 30  # 1 GiB each way
    src = torch.randint(0, 255, (n,), device="cuda", dtype=torch.uint8)
    dst = torch.empty_like(src)
    copy_ms = _median_ms(lambda: dst.copy_(src))
    # read-only and write-only rates: the update reads x in one phase and writes Y in another
    floats = src.view(torch.float32).uniform_()
    read_ms = _median_ms(lambda: floats.sum())
    write_ms = _median_ms(lambda: dst.fill_(1))
    del floats
    a = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    b = torch.randn(8192, 8192, device="cuda", dtype=DTYPE)
    mm_ms = _median_ms(lambda: a @ b)
    return {"copy_GBps": 2 * n / copy_ms / 1e6, "read_GBps": n / read_ms / 1e6, "write_GBps": n / write_ms / 1e6,
            "bf16_TFLOPs": 2 * 8192**3 / mm_ms / 1e9}


def _sets(M: int, K: int, N: int, r: int, l2_bytes: int) -> list[dict]:
    per_set = 2 * (M * K + N * K + M * N)
    count = max(1, min(8, math.ceil(3 * l2_bytes / per_set)))
    sets = []
    for _ in range(count):
        x = torch.randn(M, K, device="cuda", dtype=DTYPE)
        sets.append({
            "x": x,
            "W": (torch.randn(N, K, device="cuda", dtype=DTYPE) / K**0.5),
            "b": torch.randn(N, device="cuda", dtype=DTYPE),
            "V": (torch.randn(K, r, device="cuda", dtype=DTYPE) / K**0.5).requires_grad_(),
            "U": (torch.randn(N, r, device="cuda", dtype=DTYPE) * 0.1).requires_grad_(),
            "c": (1 + 0.1 * torch.randn(M, r, device="cuda", dtype=DTYPE)).requires_grad_(),
            "g": torch.randn(M, N, device="cuda", dtype=DTYPE),
            "xg": x.detach().clone().requires_grad_(),
        })
    return sets


def _forward_variants(sets: list[dict], s: float, M: int) -> dict[str, Callable[[int], object]]:
    def pick(i):
        return sets[i % len(sets)]

    variants = {
        "F.linear": lambda i: F.linear(pick(i)["x"], pick(i)["W"], pick(i)["b"]),
        "PEFT LoRA": lambda i: F.linear(pick(i)["x"], pick(i)["W"], pick(i)["b"])
        + (pick(i)["x"] @ pick(i)["V"].detach()) @ pick(i)["U"].detach().t() * s,
        "BEM reference": lambda i: reference.bem_linear(
            pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(), pick(i)["c"].detach(),
            pick(i)["U"].detach(), s),
        "BEM fused": lambda i: ops.bem_linear(
            pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(), pick(i)["c"].detach(),
            pick(i)["U"].detach(), s),
    }
    modes = {1: "fused decode (stream)", 5: "fused decode (tiles)", 2: "fused gemm+update",
             3: "fused update+gemm", 4: "fused gemm+addmm", 6: "fused update in gemm",
             7: "fused update in gemm (xV given)"}
    for mode, name in modes.items():
        if mode in (1, 5) and M > custom_ops.decode_max_tokens():
            continue
        if mode in (6, 7) and (M <= custom_ops.decode_max_tokens() or not custom_ops._C.fused_gemm_available()):
            continue
        variants[name] = (lambda mode: lambda i: custom_ops._C.linear_forward(
            pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(), pick(i)["c"].detach(),
            pick(i)["U"].detach(), s, mode))(mode)
    return variants


def _backward_variants(sets: list[dict], s: float) -> dict[str, Callable[[int], object]]:
    def pick(i):
        return sets[i % len(sets)]

    def frozen(i):
        d = pick(i)
        return torch.autograd.grad(F.linear(d["xg"], d["W"], d["b"]), [d["xg"]], d["g"])

    def peft(i):
        d = pick(i)
        y = F.linear(d["xg"], d["W"], d["b"]) + (d["xg"] @ d["V"]) @ d["U"].t() * s
        return torch.autograd.grad(y, [d["xg"], d["V"], d["U"]], d["g"])

    def bem(module):
        def run(i):
            d = pick(i)
            y = module.bem_linear(d["xg"], d["W"], d["b"], d["V"], d["c"], d["U"], s)
            return torch.autograd.grad(y, [d["xg"], d["V"], d["U"], d["c"]], d["g"])
        return run

    return {"F.linear": frozen, "PEFT LoRA": peft, "BEM reference": bem(reference), "BEM fused": bem(ops)}


def _tma_update_runs(operands: dict) -> bool:
    """Whether the TMA update kernel (update kernel 4) takes these operands: the extension refuses, with a
    ValueError, what this build, the GPU or the shape does not allow."""
    try:
        custom_ops._C.update_forward(operands["x"], operands["V"].detach(), operands["c"].detach(),
                                     operands["U"].detach(), 1.0, 4)
    except ValueError:
        return False
    return True


def _update_variants(sets: list[dict], s: float) -> dict[str, Callable[[int], object]]:
    def pick(i):
        return sets[i % len(sets)]

    return {
        "update reference": lambda i: reference.generated_update(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s),
        "update fused": lambda i: ops.generated_update(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s),
        "update stream kernel": lambda i: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 1),
        **{f"update stream t{tokens}": (lambda i, tokens=tokens: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 1, tokens))
           for tokens in (16, 32, 64) if tokens < 64 or sets[0]["V"].shape[1] <= 32},
        "update stream c1": lambda i: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 1, 0, 1),
        "update tiles kernel": lambda i: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 2),
        "update two GEMMs": lambda i: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 3),
        **({"update TMA kernel": lambda i: custom_ops._C.update_forward(
            pick(i)["x"], pick(i)["V"].detach(), pick(i)["c"].detach(), pick(i)["U"].detach(), s, 4)}
           if _tma_update_runs(sets[0]) else {}),
        "x V only (fused)": lambda i: custom_ops._C.project(pick(i)["x"], pick(i)["V"].detach()),
    }


def _time_interleaved(variants: dict[str, Callable[[int], object]], calls: int, rounds: int = 3) -> dict[str, float]:
    replays = {name: _graph(fn, calls) for name, fn in variants.items()}
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):  # interleave: A B C A B C ...
        for name, replay in replays.items():
            samples[name].append(_median_ms(replay) / calls)
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def bench_shape(M: int, K: int, N: int, r: int, copy_gbps: float, l2_bytes: int) -> dict:
    s = 2.0
    sets = _sets(M, K, N, r, l2_bytes)
    calls = max(len(sets), 8 if M * N * K < 1 << 34 else len(sets))
    with torch.no_grad():  # inference: the dispatch's choice for forward-only calls
        fwd = _time_interleaved(_forward_variants(sets, s, M), calls)
        upd = _time_interleaved(_update_variants(sets, s), calls)
    bwd = _time_interleaved(_backward_variants(sets, s), calls)
    update_bytes = 2 * (M * K + M * N + M * r + (K + N) * r)
    moved = {name: update_bytes for name in upd}
    moved["x V only (fused)"] = 2 * (M * K + K * r) + 4 * M * r
    return {
        "shape": {"M": M, "K": K, "N": N, "r": r},
        "forward_ms": fwd,
        "forward_backward_ms": bwd,
        "update_ms": upd,
        "update_GBps": {k: moved[k] / v / 1e6 for k, v in upd.items()},
        "update_pct_copy": {k: 100 * moved[k] / v / 1e6 / copy_gbps for k, v in upd.items()},
    }


def format_table(result: dict) -> str:
    shp = result["shape"]
    lines = [f"M={shp['M']} K={shp['K']} N={shp['N']} r={shp['r']}"]
    base_f = result["forward_ms"]["F.linear"]
    base_b = result["forward_backward_ms"]["F.linear"]
    lines.append(f"  {'variant':<22}{'fwd us':>10}{'x F.lin':>9}{'fwd+bwd us':>12}{'x F.lin':>9}")
    for name, ms in result["forward_ms"].items():
        fb = result["forward_backward_ms"].get(name)
        fb_txt = f"{fb * 1e3:>12.1f}{fb / base_b:>9.2f}" if fb is not None else ""
        lines.append(f"  {name:<22}{ms * 1e3:>10.1f}{ms / base_f:>9.2f}{fb_txt}")
    for name, ms in result["update_ms"].items():
        lines.append(f"  {name:<22}{ms * 1e3:>10.1f}  {result['update_GBps'][name]:>7.0f} GB/s"
                     f"  {result['update_pct_copy'][name]:>5.1f}% of copy")
    return "\n".join(lines)


def parse_shapes(text: str, form: str = "MxKxNxR") -> list[tuple[int, ...]]:
    """Comma-separated shapes of `form`'s dimensions (e.g. 8x768x8192 for BxHxL), for a `--shapes` option."""
    shapes = []
    for item in text.split(","):
        parts = item.strip().lower().split("x")
        if len(parts) != len(form.split("x")) or not all(part.isdigit() and int(part) > 0 for part in parts):
            raise argparse.ArgumentTypeError(f"a shape is {form} with positive integers, got {item!r}")
        shapes.append(tuple(int(part) for part in parts))
    return shapes


def main(argv: list[str] | None = None) -> None:
    import sys

    argv = list(sys.argv[1:] if argv is None else argv)
    for flag, family in (("--fftconv", "fftconv"), ("--mlstm", "mlstm"), ("--quant4", "quant")):
        if flag in argv:  # the sequence mixers' and the quantized linears' kernels have benchmarks of their own
            argv.remove(flag)
            from importlib import import_module

            return import_module(f"bem.kernels.{family}.bench").main(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="a handful of shapes")
    parser.add_argument("--shapes", type=parse_shapes, help="comma-separated MxKxNxR, e.g. 1x4096x4096x8,16384x4096x4096x32")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or not ops.KERNELS_AVAILABLE:
        raise SystemExit("the benchmark needs a CUDA GPU and the BEM extension (bem.kernels.KERNELS_AVAILABLE)")
    # measure the fused kernels themselves, also where the default dispatch would train on the reference
    ops.TRAINING_USES_REFERENCE = False
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    warm_up()
    ceil = ceilings()
    header = (f"{props.name}, torch {torch.__version__}, bf16; copy {ceil['copy_GBps']:.0f} GB/s (read+write), "
              f"read {ceil['read_GBps']:.0f} GB/s, write {ceil['write_GBps']:.0f} GB/s, "
              f"matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s")
    print(header, flush=True)
    results = []
    for M, K, N, r in args.shapes or (SHAPES_QUICK if args.quick else SHAPES_FULL):
        result = bench_shape(M, K, N, r, ceil["copy_GBps"], l2_bytes)
        results.append(result)
        print(format_table(result), flush=True)
        torch.cuda.empty_cache()
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "ceilings": ceil, "results": results}, f, indent=1)
    print("\nSummary (ratios to F.linear; update alone as % of copy bandwidth: default, PyTorch, streaming "
          "kernel (by shape, at 16/32/64 tokens a block, without a cluster), tiles kernel, two cuBLAS GEMMs, "
          "TMA kernel; in gemm: the forward as one GEMM with the update inside)")
    print(f"{'M':>6}{'K':>6}{'N':>6}{'r':>4}{'PEFT':>7}{'ref':>7}{'fused':>7}{'fb ref':>8}{'fb fused':>9}"
          f"{'upd %cp':>9}{'torch':>7}{'stream':>8}{'t16':>6}{'t32':>6}{'t64':>6}{'c1':>6}{'tiles':>7}{'gemms':>7}{'tma':>7}{'in gemm':>9}")
    for res in results:
        shp, fwd, fb = res["shape"], res["forward_ms"], res["forward_backward_ms"]
        pct = res["update_pct_copy"]
        print(f"{shp['M']:>6}{shp['K']:>6}{shp['N']:>6}{shp['r']:>4}"
              f"{fwd['PEFT LoRA'] / fwd['F.linear']:>7.2f}{fwd['BEM reference'] / fwd['F.linear']:>7.2f}"
              f"{fwd['BEM fused'] / fwd['F.linear']:>7.2f}{fb['BEM reference'] / fb['F.linear']:>8.2f}"
              f"{fb['BEM fused'] / fb['F.linear']:>9.2f}{pct['update fused']:>9.1f}{pct['update reference']:>7.1f}"
              f"{pct['update stream kernel']:>8.1f}"
              + "".join(f"{pct[f'update stream t{t}']:>6.1f}" if f"update stream t{t}" in pct else f"{'-':>6}"
                        for t in (16, 32, 64))
              + f"{pct['update stream c1']:>6.1f}{pct['update tiles kernel']:>7.1f}{pct['update two GEMMs']:>7.1f}"
              + (f"{pct['update TMA kernel']:>7.1f}" if "update TMA kernel" in pct else f"{'-':>7}")
              + (f"{fwd['fused update in gemm'] / fwd['F.linear']:>9.2f}" if "fused update in gemm" in fwd else f"{'-':>9}"))
    print(header)


if __name__ == "__main__":
    main()
