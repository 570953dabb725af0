"""The in-block streaming decode kernel called many times on the same operands: every output must equal the
first bit for bit (its sums run in a fixed order), with and without the profiler, and with calls back to back
that each have their own codes. A mismatch names the call and the error against float64.

    PYTHONPATH=. python scripts/stream_repeat_probe.py [--calls 2000]
"""

from __future__ import annotations

import argparse

import torch

from bem.kernels import custom_ops, reference
from decode_error_probe import operands  # scripts/, beside this file


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--calls", type=int, default=2000)
    args = parser.parse_args()
    _C = custom_ops.extension()
    for M, K, N, r, split in [(1, 4096, 4096, 8, 0), (16, 4096, 4096, 8, 0), (1, 2048, 8192, 16, 0), (3, 4096, 1000, 8, 8)]:
        x, W, b, V, U, codes = operands(M, K, N, r, K + N + M, draws=20)
        first = [_C.linear_forward(x, W, b, V, c, U, 1.5, 1, split, False)[0].clone() for c in codes]
        mismatches = []
        for rnd in range(args.calls // 20):
            if rnd % 10 == 0:
                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]):
                    outs = [_C.linear_forward(x, W, b, V, c, U, 1.5, 1, split, False)[0] for c in codes]
                    torch.cuda.synchronize()
            else:
                outs = [_C.linear_forward(x, W, b, V, c, U, 1.5, 1, split, False)[0] for c in codes]
            for i, (out, ref) in enumerate(zip(outs, first)):
                if not torch.equal(out, ref):
                    ref64 = reference.bem_linear(x.double(), W.double(), b.double(), V.double(), codes[i].double(),
                                                 U.double(), 1.5)
                    err = ((out.double() - ref64).norm() / ref64.norm()).item()
                    mismatches.append((rnd, i, err, int((out != ref).sum())))
        torch.cuda.synchronize()
        print(f"{M}x{K}x{N}x{r} split {split}: {args.calls // 20 * 20} calls, {len(mismatches)} differ from the first"
              + (f"; first few (round, call, err, elements): {mismatches[:5]}" if mismatches else ""), flush=True)


if __name__ == "__main__":
    main()
