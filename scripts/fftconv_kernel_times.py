"""Where the fftconv op's time goes: each CUDA kernel's device time per call, from torch.profiler, forward and
forward+backward (bf16 u and k, float32 D, both gates unless --no-gates, as the benchmark), at the benchmark's shapes.

    python3 scripts/fftconv_kernel_times.py [--shapes 8x768x8192,1x768x1048576] [--calls 10] [--no-gates]
"""

from __future__ import annotations

import argparse
from typing import Callable

import torch

from bem.kernels.fftconv import dispatch
from profiled_kernels import kernel_times


def workloads(spec: str, gates: bool = True) -> tuple[Callable[[], None], Callable[[], None]]:
    """The op's forward (no grad) and forward+backward at B x H x L = spec, on fresh random operands: bf16 u, k
    and gates (None without `gates`), float32 D (also what scripts/fftconv_ncu.py profiles)."""
    B, H, L = (int(x) for x in spec.split("x"))
    u = torch.randn(B, H, L, device="cuda", dtype=torch.bfloat16, requires_grad=True)
    k = (torch.randn(H, L, device="cuda") / L**0.5).to(torch.bfloat16).requires_grad_()
    D = torch.randn(H, device="cuda", requires_grad=True)
    pre, post = (torch.randn(B, H, L, device="cuda", dtype=torch.bfloat16, requires_grad=True) if gates else None
                 for _ in range(2))
    dy = torch.randn_like(u)
    wrt = tuple(t for t in (u, k, D, pre, post) if t is not None)

    def fwd() -> None:
        with torch.no_grad():
            dispatch.fftconv(u, k, D, pre, post)

    def fwd_bwd() -> None:
        torch.autograd.grad(dispatch.fftconv(u, k, D, pre, post), wrt, dy)

    return fwd, fwd_bwd


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default="8x768x8192,8x768x1024,1x768x1048576")
    parser.add_argument("--calls", type=int, default=10)
    parser.add_argument("--no-gates", dest="gates", action="store_false", help="no pre- and post-gate")
    args = parser.parse_args()
    for spec in args.shapes.split(","):
        for label, fn in zip(("fwd", "fwd+bwd"), workloads(spec, args.gates)):
            times = kernel_times(fn, args.calls)
            print(f"== {spec} {label}: {sum(times.values()):.1f} us of kernels per call")
            for name, us in sorted(times.items(), key=lambda kv: -kv[1])[:12]:
                print(f"   {us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
