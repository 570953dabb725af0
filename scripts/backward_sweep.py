"""Forward + backward of the BEM linear with each way of computing the prefill backward's dX, in one
process: the update kernels on dY and cuBLAS adding dY W ("update"), or the fused GEMM given s (dY U) ⊙ codes
with W read transposed ("gemm"); ratios to the frozen linear's forward + backward (grad for x only),
CUDA-graph GPU time. With --grads: instead the low-rank pieces' two ways ("fused": two launches; "composed":
cuBLAS projections, the coefficient kernel and cuBLAS GEMMs), dX from the fused GEMM where it takes the operands.

    PYTHONPATH=. python scripts/backward_sweep.py [--shapes 512x4096x4096x8,...] [--grads]

Without --shapes: M from 128 to 16384 over the benchmark's shapes and 2048².
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bem.kernels import bench, custom_ops, ops

SCALING = 0.5


def default_shapes() -> list[tuple[int, int, int, int]]:
    shapes = []
    for M in (128, 512, 1024, 4096, 16384):
        shapes += [(M, 4096, 4096, r) for r in (8, 16, 32, 64)]
        for K, N in ((4096, 14336), (14336, 4096), (2048, 2048), (768, 768)):
            shapes += [(M, K, N, r) for r in (8, 32)]
    return shapes


def sweep_row(M: int, K: int, N: int, r: int, l2_bytes: int, grads: bool = False) -> dict[str, float]:
    sets = bench._sets(M, K, N, r, l2_bytes)

    def pick(i: int) -> dict:
        return sets[i % len(sets)]

    def frozen(i: int):
        d = pick(i)
        return torch.autograd.grad(F.linear(d["xg"], d["W"], d["b"]), [d["xg"]], d["g"])

    def bem(path, grads_path=None):
        def run(i: int):
            d = pick(i)
            with custom_ops.prefill_dx_path(path), custom_ops.prefill_grads_path(grads_path):
                y = ops.bem_linear(d["xg"], d["W"], d["b"], d["V"], d["c"], d["U"], SCALING)
                return torch.autograd.grad(y, [d["xg"], d["V"], d["U"], d["c"]], d["g"])
        return run

    in_gemm = custom_ops.extension().gemm_update_given_takes(sets[0]["g"], sets[0]["W"].t(), sets[0]["V"])
    if grads:
        dx = "gemm" if in_gemm else None
        variants = {"frozen": frozen, "fused": bem(dx, "fused"), "composed": bem(dx, "composed")}
    else:
        variants = {"frozen": frozen, "default": bem(None), "update": bem("update")}
        if in_gemm:
            variants["gemm"] = bem("gemm")
    return bench._time_interleaved(variants, calls=10)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", type=bench.parse_shapes, help="comma-separated MxKxNxR")
    parser.add_argument("--grads", action="store_true", help="compare the low-rank pieces' two ways instead")
    args = parser.parse_args()
    shapes = args.shapes or default_shapes()
    ops.TRAINING_USES_REFERENCE = False  # the fused ops under autograd at every size
    bench.warm_up()
    props = torch.cuda.get_device_properties(0)
    names = ("fused", "composed") if args.grads else ("default", "update", "gemm")
    print(f"{props.name}, {props.multi_processor_count} multiprocessors; forward + backward x the frozen linear's")
    print(f"{'M':>6}{'K':>7}{'N':>7}{'r':>4}{'frozen us':>10}" + "".join(f"{n:>9}" for n in names), flush=True)
    for M, K, N, r in shapes:
        t = sweep_row(M, K, N, r, props.L2_cache_size, args.grads)
        print(f"{M:>6}{K:>7}{N:>7}{r:>4}{t['frozen'] * 1e3:>10.1f}"
              + "".join(f"{t[n] / t['frozen']:>9.2f}" if n in t else f"{'-':>9}" for n in names), flush=True)


if __name__ == "__main__":
    main()
