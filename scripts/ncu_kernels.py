"""One launch of each kernel worth profiling, for Nsight Compute:

    ncu --clock-control none -k regex:'stream_kernel|gemv|nvjet' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis --section Occupancy --section WarpStateStats \
        python3 scripts/ncu_kernels.py

Each kernel runs once on fresh random inputs: its first launch is the one profiled. `--decode MxKxNxr,...`
runs instead, at each shape, the decode dispatch (`linear_forward`, mode 0, or `--mode`/`--split` for one kernel
and split: 9 is the TMA kernel) and `F.linear` beside it (scripts/decode_ncu.sh).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bem.kernels import bench, custom_ops

DT = torch.bfloat16


def operands(M: int, K: int, N: int, r: int):
    x = torch.randn(M, K, device="cuda", dtype=DT)
    W = torch.randn(N, K, device="cuda", dtype=DT) / K**0.5
    V = torch.randn(K, r, device="cuda", dtype=DT) / K**0.5
    U = torch.randn(N, r, device="cuda", dtype=DT)
    c = torch.randn(M, r, device="cuda", dtype=DT)
    b = torch.randn(N, device="cuda", dtype=DT)
    return x, W, b, V, c, U


def decode_shapes(shapes: str, mode: int = 0, split: int = 0) -> None:
    C = custom_ops.extension()
    for M, K, N, r in bench.parse_shapes(shapes):
        x, W, b, V, c, U = operands(M, K, N, r)
        C.linear_forward(x, W, b, V, c, U, 1.0, mode, split, False)
        F.linear(x, W, b)
    torch.cuda.synchronize()


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--decode", help="comma-separated MxKxNxr: the decode dispatch and F.linear at each")
    parser.add_argument("--mode", type=int, default=0, help="the linear mode at --decode's shapes (0: the dispatch)")
    parser.add_argument("--split", type=int, default=0, help="its split of K (0: chosen by shape)")
    args = parser.parse_args()
    if args.decode:
        decode_shapes(args.decode, args.mode, args.split)
        return
    C = custom_ops.extension()
    for r, tokens in ((8, 16), (8, 64), (32, 32), (64, 16)):
        x, W, b, V, c, U = operands(16384, 4096, 4096, r)
        C.update_forward(x, V, c, U, 1.0, 1, tokens)
    for r in (8, 32):
        x, W, b, V, c, U = operands(1, 4096, 4096, r)
        C.linear_forward(x, W, b, V, c, U, 1.0, 1, 0, False)
    x, W, b, V, c, U = operands(1, 4096, 4096, 8)
    F.linear(x, W, b)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
