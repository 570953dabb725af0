"""`--kernels`: the generated-update op against the plain PyTorch pattern, and its accuracy.

Speed: `bem.kernels.ops.generated_update` (the dispatch point: fused kernel when built, reference
otherwise) and `((x V) * codes) U^T * s` written out in PyTorch, timed interleaved, reported as
effective GB/s (bytes the op must read and write) and as a share of a device-to-device copy's
bandwidth measured in the same run. Accuracy: `validate_numerical_accuracy` against float64.
"""

from __future__ import annotations

import math
from typing import Any, Optional

import torch

from ..kernels import ops
from .config import KernelSpec
from .models import DTYPE_BY_NAME
from .timing import Clock, interleaved, median, warm_up_gpu

SCALING = 2.0
TARGET_ROTATION_BYTES = 128 * 2**20  # rotate inputs over more than any L2 cache holds


def _inputs(M: int, K: int, N: int, r: int, dtype: torch.dtype, device: torch.device,
            generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    def rand(*shape: int, scale: float = 1.0) -> torch.Tensor:
        return (torch.randn(*shape, generator=generator) * scale).to(device=device, dtype=dtype)

    return rand(M, K), rand(K, r, scale=K ** -0.5), 1.0 + rand(M, r, scale=0.3), rand(N, r, scale=r ** -0.5)


def pytorch_update(x: torch.Tensor, V: torch.Tensor, codes: torch.Tensor, U: torch.Tensor, s: float) -> torch.Tensor:
    """The unfused pattern: three kernels and two intermediates."""
    return torch.matmul(torch.matmul(x, V) * codes, U.t()) * s


def update_bytes(M: int, K: int, N: int, r: int, element_size: int) -> int:
    """Bytes the op cannot avoid: read x, V, codes, U once; write the output once."""
    return element_size * (M * K + K * r + M * r + N * r + M * N)


def copy_bandwidth_gbps(device: torch.device, clock: Clock, repeats: int) -> float:
    numel = (256 if device.type == "cuda" else 32) * 2**20 // 4
    src = torch.randn(numel, device=device)
    dst = torch.empty_like(src)
    samples = interleaved({"copy": lambda _: dst.copy_(src)}, clock, warmup=2, repeats=repeats)["copy"]
    return 2 * src.numel() * src.element_size() / (median(samples) * 1e-3) / 1e9


def matmul_tflops(device: torch.device, clock: Clock, repeats: int) -> float:
    n, dtype = (8192, torch.bfloat16) if device.type == "cuda" else (512, torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    samples = interleaved({"mm": lambda _: a @ b}, clock, warmup=2, repeats=repeats)["mm"]
    return 2 * n ** 3 / (median(samples) * 1e-3) / 1e12


def _benchmark_shape(shape: list[int], dtype: torch.dtype, device: torch.device, clock: Clock,
                     copy_gbps: float, repeats: int, seed: int) -> dict[str, Any]:
    M, K, N, r = shape
    element_size = torch.tensor([], dtype=dtype).element_size()
    nbytes = update_bytes(M, K, N, r, element_size)
    sets = 2 if device.type == "cpu" else min(64, max(2, math.ceil(TARGET_ROTATION_BYTES / nbytes)))
    generator = torch.Generator().manual_seed(seed)
    inputs = [_inputs(M, K, N, r, dtype, device, generator) for _ in range(sets)]

    def dispatch(_: int) -> None:
        for x, V, codes, U in inputs:
            ops.generated_update(x, V, codes, U, SCALING)

    def plain(_: int) -> None:
        for x, V, codes, U in inputs:
            pytorch_update(x, V, codes, U, SCALING)

    with torch.inference_mode():
        samples = interleaved({"dispatch": dispatch, "pytorch": plain}, clock, warmup=2, repeats=repeats)
    dispatch_ms = median(samples["dispatch"]) / sets
    pytorch_ms = median(samples["pytorch"]) / sets
    dispatch_gbps = nbytes / (dispatch_ms * 1e-3) / 1e9
    pytorch_gbps = nbytes / (pytorch_ms * 1e-3) / 1e9
    return {
        "shape": {"tokens": M, "in_features": K, "out_features": N, "rank": r},
        "dtype": str(dtype).replace("torch.", ""),
        "backend": "fused" if ops.KERNELS_AVAILABLE else "reference",
        "dispatch_ms": dispatch_ms,
        "pytorch_ms": pytorch_ms,
        "speedup": pytorch_ms / dispatch_ms,
        "bytes": nbytes,
        "dispatch_gbps": dispatch_gbps,
        "pytorch_gbps": pytorch_gbps,
        "dispatch_pct_of_copy": 100 * dispatch_gbps / copy_gbps,
        "pytorch_pct_of_copy": 100 * pytorch_gbps / copy_gbps,
    }


def validate_numerical_accuracy(shape: list[int], dtype: torch.dtype, device: torch.device,
                                seed: int = 0) -> dict[str, Any]:
    """The op's error against float64 on fresh random inputs, bounded by a small multiple of the error
    plain PyTorch makes in the same precision. NaN or inf never passes."""
    M, K, N, r = shape
    generator = torch.Generator().manual_seed(seed)
    x, V, codes, U = _inputs(M, K, N, r, dtype, device, generator)
    with torch.inference_mode():
        reference = pytorch_update(*(t.double() for t in (x, V, codes, U)), SCALING)
        out = ops.generated_update(x, V, codes, U, SCALING).double()
        plain = pytorch_update(x, V, codes, U, SCALING).double()
    norm = reference.norm().item()
    relative = ((out - reference).norm().item() / norm) if norm > 0 else float("inf")
    pytorch_relative = (plain - reference).norm().item() / norm if norm > 0 else float("inf")
    tolerance = max(4.0 * pytorch_relative, torch.finfo(dtype).eps)
    max_abs = (out - reference).abs().max().item()
    finite = math.isfinite(relative) and math.isfinite(max_abs)
    return {
        "shape": {"tokens": M, "in_features": K, "out_features": N, "rank": r},
        "dtype": str(dtype).replace("torch.", ""),
        "max_abs_error": max_abs if finite else None,
        "relative_error": relative if finite else None,
        "pytorch_relative_error": pytorch_relative,
        "tolerance": tolerance,
        "passed": bool(finite and relative <= tolerance),
    }


def fused_bench(spec: KernelSpec, device: torch.device) -> Optional[dict[str, Any]]:
    """`bem.kernels.bench` per shape (CUDA-graph GPU time of every fused variant, bf16), where it can run:
    a GPU with the extension loaded. Its failure is recorded in the report, not raised."""
    if device.type != "cuda" or not ops.KERNELS_AVAILABLE:
        return None
    try:
        from ..kernels import bench

        props = torch.cuda.get_device_properties(device)
        l2_bytes = getattr(props, "L2_cache_size", 50 << 20)
        ceilings = bench.ceilings()
        results = []
        for M, K, N, r in spec.shapes:
            results.append(bench.bench_shape(M, K, N, r, ceilings["copy_GBps"], l2_bytes))
            torch.cuda.empty_cache()
        return {"ceilings": ceilings, "results": results}
    except Exception as err:  # noqa: BLE001 - the rest of the report stands; the error is shown and kept
        return {"error": f"{type(err).__name__}: {err}"}


def run_kernel_benchmark(spec: KernelSpec, device: torch.device, repeats: int = 7, seed: int = 0,
                         gpu_warmup_seconds: float = 0.0) -> dict[str, Any]:
    """Speed rows, accuracy rows and the copy / matmul ceilings, all from this run."""
    warm_up_gpu(device, gpu_warmup_seconds)
    clock = Clock(device)
    dtype = DTYPE_BY_NAME[spec.dtype]
    copy_gbps = copy_bandwidth_gbps(device, clock, repeats)
    tflops = matmul_tflops(device, clock, repeats)
    rows = [_benchmark_shape(shape, dtype, device, clock, copy_gbps, repeats, seed + i)
            for i, shape in enumerate(spec.shapes)]
    accuracy = [validate_numerical_accuracy(shape, dtype, device, seed=seed + 1000 + i)
                for i, shape in enumerate(spec.shapes)]
    return {
        "device": torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
        "kernels_available": bool(ops.KERNELS_AVAILABLE),
        "copy_gbps": copy_gbps,
        "matmul_tflops": tflops,
        "benchmarks": rows,
        "accuracy": accuracy,
        "passed": all(row["passed"] for row in accuracy),
        "fused_bench": fused_bench(spec, device),
    }


def format_kernel_table(report: dict[str, Any]) -> str:
    lines = [f"{report['device']}: copy {report['copy_gbps']:.1f} GB/s, matmul {report['matmul_tflops']:.2f} TFLOP/s; "
             f"op backend: {'fused CUDA' if report['kernels_available'] else 'PyTorch reference'}"]
    header = f"{'M x K -> N, r':<24}{'dtype':>10}{'op ms':>10}{'torch ms':>10}{'op GB/s':>10}{'% copy':>8}{'speedup':>9}"
    lines += [header, "-" * len(header)]
    for row in report["benchmarks"]:
        s = row["shape"]
        label = f"{s['tokens']} x {s['in_features']} -> {s['out_features']}, {s['rank']}"
        lines.append(f"{label:<24}{row['dtype']:>10}{row['dispatch_ms']:>10.4f}{row['pytorch_ms']:>10.4f}"
                     f"{row['dispatch_gbps']:>10.1f}{row['dispatch_pct_of_copy']:>7.1f}%{row['speedup']:>8.2f}x")
    lines += ["", f"{'accuracy vs float64':<24}{'rel err':>12}{'torch rel':>12}{'tolerance':>12}{'max abs':>12}  ok"]
    for row in report["accuracy"]:
        s = row["shape"]
        label = f"{s['tokens']} x {s['in_features']} -> {s['out_features']}, {s['rank']}"
        relative, max_abs = (("nan/inf", "nan/inf") if row["relative_error"] is None
                             else (f"{row['relative_error']:.2e}", f"{row['max_abs_error']:.2e}"))
        lines.append(f"{label:<24}{relative:>12}{row['pytorch_relative_error']:>12.2e}"
                     f"{row['tolerance']:>12.2e}{max_abs:>12}  {'yes' if row['passed'] else 'NO'}")
    bench = report.get("fused_bench")
    if bench and "error" in bench:
        lines += ["", f"bem.kernels.bench failed: {bench['error']}"]
    elif bench:
        from ..kernels.bench import format_table

        ceilings = bench["ceilings"]
        lines += ["", f"bem.kernels.bench (CUDA-graph GPU time, bf16; copy {ceilings['copy_GBps']:.0f} GB/s, "
                      f"matmul {ceilings['bf16_TFLOPs']:.0f} TFLOP/s):"]
        lines += [format_table(result) for result in bench["results"]]
    return "\n".join(lines)
