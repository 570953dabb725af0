"""Benchmark of the fftconv op: `python -m bem.kernels.bench --fftconv [--quick] [--json FILE]`.

In one process, interleaved, bf16 u and k with a float32 D: the PyTorch rfft path (`reference.fftconv_fft`),
the op (the filter's spectrum computed per call, as in training), the op given a cached spectrum (inference),
forward and forward+backward; the byte floor is u read once and y written once at the device-to-device
copy rate measured in the same run. Each variant is captured in a CUDA graph cycling through input sets
larger than L2 and timed by its replays (median of CUDA-event timings); the largest shapes, whose graphs would
hold tens of GB, run eagerly. Then the decoding step at B 1, H 768 against an 8K context (µs per call).
"""

from __future__ import annotations

import argparse
import json
import math
import os
from typing import Callable

import torch

from .. import bench as common
from . import custom_ops, dispatch, reference

DTYPE = torch.bfloat16
SHAPES = [(8, 768, 1024), (8, 768, 4096), (8, 768, 8192), (8, 768, 16384), (8, 864, 3000), (1, 768, 1 << 20),
          # rows whose byte length is not a multiple of 16 (L not a multiple of 8), each with an aligned length of
          # the same transform size; small batches
          (8, 768, 1021), (2, 768, 3000), (2, 768, 3001), (1, 768, 4096), (4, 768, 4096)]
SHAPES_QUICK = [(8, 768, 1024), (8, 768, 8192), (8, 864, 3000)]
EAGER_ABOVE = 1 << 28  # elements of u past which a variant runs eagerly (no graph holding its memory)


def _sets(B: int, H: int, L: int, l2_bytes: int) -> list[dict]:
    per_set = 2 * 3 * B * H * L  # u, grad, y in bf16
    count = max(1, min(4, math.ceil(3 * l2_bytes / per_set)))
    sets = []
    for _ in range(count):
        u = torch.randn(B, H, L, device="cuda", dtype=DTYPE)
        k = (torch.randn(H, L, device="cuda") * L**-0.5).to(DTYPE)
        D = torch.randn(H, device="cuda")
        sets.append({"u": u, "k": k, "D": D, "S": custom_ops.fftconv_spectrum(k, L),
                     "g": torch.randn_like(u),
                     "ug": u.detach().clone().requires_grad_(), "kg": k.detach().clone().requires_grad_(),
                     "Dg": D.detach().clone().requires_grad_()})
    return sets


def _block_kernels(fn: Callable[[int], object]) -> Callable[[int], object]:
    """fn with the tensor-core forward switched off (BEM_FFTCONV_TENSOR_CORES=0, read per call; a captured graph
    keeps the kernel chosen while it was captured): the block kernels it replaces, timed beside it."""
    def run(i):
        before = os.environ.get("BEM_FFTCONV_TENSOR_CORES")
        os.environ["BEM_FFTCONV_TENSOR_CORES"] = "0"
        try:
            return fn(i)
        finally:
            if before is None:
                del os.environ["BEM_FFTCONV_TENSOR_CORES"]
            else:
                os.environ["BEM_FFTCONV_TENSOR_CORES"] = before
    return run


def _variants(sets: list[dict]) -> tuple[dict[str, Callable[[int], object]], dict[str, Callable[[int], object]]]:
    def pick(i):
        return sets[i % len(sets)]

    forward = {
        "torch": lambda i: reference.fftconv_fft(pick(i)["u"], pick(i)["k"], pick(i)["D"]),
        "op": lambda i: custom_ops.fftconv(pick(i)["u"], pick(i)["k"], pick(i)["D"], None, None, False, None),
        "op, cached S": lambda i: custom_ops.fftconv(pick(i)["u"], pick(i)["k"], pick(i)["D"], None, None, False,
                                                     pick(i)["S"]),
        "op, block kernels": _block_kernels(lambda i: custom_ops.fftconv(pick(i)["u"], pick(i)["k"], pick(i)["D"],
                                                                         None, None, False, None)),
    }

    def grads(fn):
        def run(i):
            d = pick(i)
            return torch.autograd.grad(fn(d["ug"], d["kg"], d["Dg"]), [d["ug"], d["kg"], d["Dg"]], d["g"])
        return run

    backward = {"torch": grads(reference.fftconv_fft), "op": grads(lambda u, k, D: dispatch.fftconv(u, k, D))}
    return forward, backward


def _time_eager(variants: dict[str, Callable[[int], object]], rounds: int = 3) -> dict[str, float]:
    samples: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, fn in variants.items():
            try:
                samples[name].append(common._median_ms(lambda: fn(0)))
            except torch.cuda.OutOfMemoryError:
                samples[name].append(float("nan"))
            torch.cuda.empty_cache()
    return {name: sorted(v)[len(v) // 2] for name, v in samples.items()}


def bench_shape(B: int, H: int, L: int, copy_gbps: float, l2_bytes: int) -> dict:
    sets = _sets(B, H, L, l2_bytes)
    forward, backward = _variants(sets)
    eager = B * H * L > EAGER_ABOVE
    calls = max(len(sets), 4)
    with torch.no_grad():
        fwd = _time_eager(forward) if eager else common._time_interleaved(forward, calls)
    torch.cuda.empty_cache()
    fb = _time_eager(backward) if eager else common._time_interleaved(backward, calls)
    floor_ms = 2 * 2 * B * H * L / copy_gbps / 1e6  # read u, write y, bf16
    return {"shape": {"B": B, "H": H, "L": L}, "forward_ms": fwd, "forward_backward_ms": fb,
            "floor_ms": floor_ms, "eager": eager}


def bench_step(copy_gbps: float, B: int = 1, H: int = 768, context: int = 8192) -> dict:
    history = torch.randn(B, H, context, device="cuda", dtype=DTYPE)
    k = (torch.randn(H, context, device="cuda") * context**-0.5).to(DTYPE)
    D = torch.randn(H, device="cuda")
    u_t = torch.randn(B, H, device="cuda", dtype=DTYPE)
    position = torch.tensor(context - 1, device="cuda")
    calls = 20
    variants = {
        "step kernel": lambda i: custom_ops.fftconv_step(history, u_t, k, position, 0, D, None, None, False),
        "torch step": lambda i: reference.fftconv_step(history, u_t, k, context - 1, D),
    }
    times = common._time_interleaved(variants, calls)
    bytes_read = 2 * B * H * context * 2  # history and k read once, bf16 (at half the read+write copy rate)
    return {"shape": {"B": B, "H": H, "context": context}, "us": {k: v * 1e3 for k, v in times.items()},
            "floor_us": bytes_read / (copy_gbps / 2) / 1e3}


def transform_size(L: int) -> int:
    """The FFT length of a causal convolution of length L: the power of two at or above 2L."""
    return 1 << (2 * L - 1).bit_length()


def same_transform_pairs(shapes: list[tuple[int, int, int]]) -> list[tuple[tuple[int, int, int], tuple[int, int, int]]]:
    """(shape, its comparison) for each (B, H, L) that is not a power-of-two L: the nearest L that is one, or else
    a multiple of 8, with the same batch and transform size (any H, per row), so a length off the aligned grid is
    compared per row with one on it."""
    pairs = []
    for shape in shapes:
        B, _, L = shape
        if L & (L - 1) == 0:
            continue
        peers = [other for other in shapes if other != shape and other[0] == B and other[2] % 8 == 0
                 and transform_size(other[2]) == transform_size(L) and (L % 8 != 0 or other[2] & (other[2] - 1) == 0)]
        if peers:
            pairs.append((shape, min(peers, key=lambda other: (abs(other[2] - L), other[1] != shape[1]))))
    return pairs


def format_table(results: list[dict], step: dict, device: str) -> str:
    lines = [f"fftconv, {device}, bf16 u and k, float32 D; ratios: x torch = PyTorch rfft path's time / the op's "
             "(higher is better), x floor = the op's time / the byte floor (read u, write y at copy rate)",
             f"{'B':>3}{'H':>5}{'L':>9} | {'fwd torch':>10}{'fwd op':>9}{'x torch':>8}{'x floor':>8}"
             f"{'cached S':>9}{'x floor':>8}{'blocks':>8} | {'f+b torch':>10}{'f+b op':>9}{'x torch':>8}  (ms; "
             "blocks: the forward on the block kernels, where the tensor-core one takes the call)"]
    for r in results:
        s, f, fb = r["shape"], r["forward_ms"], r["forward_backward_ms"]
        lines.append(
            f"{s['B']:>3}{s['H']:>5}{s['L']:>9} | {f['torch']:>10.3f}{f['op']:>9.3f}{f['torch'] / f['op']:>8.2f}"
            f"{f['op'] / r['floor_ms']:>8.2f}{f['op, cached S']:>9.3f}{f['op, cached S'] / r['floor_ms']:>8.2f}"
            f"{f['op, block kernels']:>8.3f} | "
            f"{fb['torch']:>10.3f}{fb['op']:>9.3f}{fb['torch'] / fb['op']:>8.2f}" + ("  eager" if r["eager"] else ""))
    by_shape = {(r["shape"]["B"], r["shape"]["H"], r["shape"]["L"]): r for r in results}
    for odd, aligned in same_transform_pairs(list(by_shape)):
        per_row = [by_shape[key]["forward_ms"]["op"] / (key[0] * key[1]) for key in (odd, aligned)]
        lines.append(f"B {odd[0]} H {odd[1]} L {odd[2]} against L {aligned[2]} (H {aligned[1]}), the same transform "
                     f"size, forward per (b, h) row: {per_row[0] / per_row[1]:.2f}x")
    us = step["us"]
    lines.append(f"decode step, B {step['shape']['B']}, H {step['shape']['H']}, context {step['shape']['context']}: "
                 f"kernel {us['step kernel']:.1f} us, PyTorch {us['torch step']:.1f} us per call (CUDA graph replays); "
                 f"byte floor {step['floor_us']:.1f} us")
    return "\n".join(lines)


def _shapes(text: str) -> list[tuple[int, ...]]:
    return common.parse_shapes(text, "BxHxL")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="three shapes")
    parser.add_argument("--shapes", type=_shapes, help="BxHxL shapes instead, comma-separated: 1x768x1048576")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or custom_ops.extension() is None:
        raise SystemExit("the fftconv benchmark needs a CUDA GPU and the fftconv kernels")
    props = torch.cuda.get_device_properties(0)
    l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
    common.warm_up()
    ceil = common.ceilings()
    print(f"{props.name}, torch {torch.__version__}; copy {ceil['copy_GBps']:.0f} GB/s (read+write)", flush=True)
    results = []
    for B, H, L in args.shapes or (SHAPES_QUICK if args.quick else SHAPES):
        results.append(bench_shape(B, H, L, ceil["copy_GBps"], l2_bytes))
        print(json.dumps(results[-1]), flush=True)
        torch.cuda.empty_cache()
    step = bench_step(ceil["copy_GBps"])
    table = format_table(results, step, props.name)
    print(table)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "ceilings": ceil, "results": results, "step": step, "table": table}, f,
                      indent=1)


if __name__ == "__main__":
    main()
