"""One forward and one forward+backward of the fftconv op at one shape, for Nsight Compute to profile (the
operands of scripts/fftconv_kernel_times.py: bf16 u and k, float32 D, both gates unless --no-gates follows the
shape):

    ncu --clock-control none -k regex:backward_kernel -c 1 --set full python3 scripts/fftconv_ncu.py 8x768x8192
"""

from __future__ import annotations

import sys

import torch

from fftconv_kernel_times import workloads


def main() -> None:
    for fn in workloads(sys.argv[1] if len(sys.argv) > 1 else "8x768x8192", "--no-gates" not in sys.argv[2:]):
        fn()
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
