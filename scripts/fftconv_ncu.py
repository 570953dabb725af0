"""One forward and one forward+backward of the fftconv op at one shape, for Nsight Compute to profile (bf16 u
and k, float32 D, both gates: the benchmark's setting):

    ncu --clock-control none -k regex:backward_kernel -c 1 --set full python3 scripts/fftconv_ncu.py 8x768x8192
"""

from __future__ import annotations

import sys

import torch

from bem.kernels.fftconv import dispatch


def main() -> None:
    B, H, L = (int(x) for x in (sys.argv[1] if len(sys.argv) > 1 else "8x768x8192").split("x"))
    u = torch.randn(B, H, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = (torch.randn(H, L, device="cuda") / L**0.5).to(torch.bfloat16).requires_grad_()
    D = torch.randn(H, device="cuda", requires_grad=True)
    pre, post = (torch.randn(B, H, L, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
    with torch.no_grad():
        dispatch.fftconv(u, k, D, pre, post)
    torch.autograd.grad(dispatch.fftconv(u, k, D, pre, post), (u, k, D, pre, post), torch.randn_like(u))
    torch.cuda.synchronize()


if __name__ == "__main__":
    main()
