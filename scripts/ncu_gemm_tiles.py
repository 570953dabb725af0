"""One launch each of cuBLAS's GEMM and the GEMM with the update inside at a few hundred rows (M = 512,
4096²), for Nsight Compute: modes 6 at 128 and 256 columns (r = 8) and 7 at 128 columns (r = 32).

    ncu --clock-control none -k regex:'gemm_update|nvjet|sm90' --section SpeedOfLight \
        --section MemoryWorkloadAnalysis python3 scripts/ncu_gemm_tiles.py
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from bem.kernels import custom_ops
from ncu_kernels import operands


def main() -> None:
    C = custom_ops._C
    x, W, b, V, c, U = operands(512, 4096, 4096, 8)
    F.linear(x, W, b)
    C.linear_forward(x, W, b, V, c, U, 1.0, 6, 0, False, None, 128)
    C.linear_forward(x, W, b, V, c, U, 1.0, 6, 0, False, None, 256)
    x, W, b, V, c, U = operands(512, 4096, 4096, 32)
    C.linear_forward(x, W, b, V, c, U, 1.0, 7, 0, False, None, 128)
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
