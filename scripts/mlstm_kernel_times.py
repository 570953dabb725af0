"""Where the mLSTM op's time goes: each CUDA kernel's device time per call, from torch.profiler, for the
forward and the forward+backward at the benchmark's shapes (bf16), beside SDPA causal's.

    python3 scripts/mlstm_kernel_times.py [--shapes 8x16x2048x64,4x8x8192x128] [--calls 20]
    ncu -k regex:mlstm --section WarpStateStats python3 scripts/mlstm_kernel_times.py --once --shapes ...
"""

from __future__ import annotations

import argparse
from collections import defaultdict

import torch
import torch.nn.functional as F

from bem.kernels.mlstm import custom_ops, dispatch
from profiled_kernels import kernel_times

DEFAULT_SHAPES = "8x16x2048x64,4x8x8192x128,1x8x65536x128"


def _inputs(B: int, NH: int, S: int, D: int) -> list[torch.Tensor]:
    q, k, v = (torch.randn(B, NH, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
    i = (torch.rand(B, NH, S, device="cuda") * 8 - 4).to(torch.bfloat16).requires_grad_()
    f = (torch.rand(B, NH, S, device="cuda") * 6 + 2).to(torch.bfloat16).requires_grad_()
    return [q, k, v, i, f]


def width_sweep(shapes: str) -> None:
    """The forward and the backward's kernels (extension calls) with the state pass at 16, 32 and 64 columns of
    DV a block, and at the width it picks: median ms of interleaved rounds."""
    from triton.testing import do_bench

    ext = custom_ops.extension()
    print("shape | state_cols | forward ms | backward ms")
    for spec in shapes.split(","):
        B, NH, S, D = (int(x) for x in spec.split("x"))
        q, k, v, i, f = (t.detach() for t in _inputs(B, NH, S, D))
        dh = torch.randn_like(v)
        fwd = ext.mlstm_forward(q, k, v, i, f)
        h, m_tok, den_tok, C_states, n_states, m_states = fwd[0], fwd[4], fwd[5], fwd[6], fwd[7], fwd[8]
        beta = ext.mlstm_beta(dh, h, m_tok, den_tok)
        times: dict[int, list[tuple[float, float]]] = defaultdict(list)
        for _ in range(3):
            for cols in (0, 16, 32, 64):
                f_ms = do_bench(lambda: ext.mlstm_forward(q, k, v, i, f, state_cols=cols), warmup=10, rep=50,
                                return_mode="median")
                b_ms = do_bench(lambda: ext.mlstm_backward(dh, q, k, v, i, f, m_tok, den_tok, beta, C_states,
                                                           n_states, m_states, state_cols=cols),
                                warmup=10, rep=50, return_mode="median")
                times[cols].append((f_ms, b_ms))
        for cols, runs in times.items():
            f_med = sorted(r[0] for r in runs)[1]
            b_med = sorted(r[1] for r in runs)[1]
            print(f"{spec} | {cols or 'auto'} | {f_med:.4f} | {b_med:.4f}")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--shapes", default=DEFAULT_SHAPES)
    parser.add_argument("--calls", type=int, default=20)
    parser.add_argument("--once", action="store_true", help="one forward+backward a shape, unprofiled (for ncu)")
    parser.add_argument("--widths", action="store_true", help="time the state pass at each width of DV a block")
    args = parser.parse_args()
    if args.widths:
        width_sweep(args.shapes)
        return
    for spec in args.shapes.split(","):
        B, NH, S, D = (int(x) for x in spec.split("x"))
        q, k, v, i, f = _inputs(B, NH, S, D)
        dh = torch.randn_like(v)

        def fwd():
            with torch.no_grad():
                dispatch.mlstm(q, k, v, i, f)

        def fwd_bwd():
            h = dispatch.mlstm(q, k, v, i, f)
            torch.autograd.grad(h, (q, k, v, i, f), dh)

        def sdpa():
            with torch.no_grad():
                F.scaled_dot_product_attention(q, k, v, is_causal=True)

        if args.once:
            fwd_bwd()
            torch.cuda.synchronize()
            continue
        for label, fn in (("SDPA causal fwd", sdpa), ("mLSTM fwd", fwd), ("mLSTM fwd+bwd", fwd_bwd)):
            times = kernel_times(fn, args.calls, name_width=90)
            total = sum(times.values())
            print(f"== {B}x{NH}x{S}x{D} {label}: {total:.1f} us of kernels per call")
            for name, us in sorted(times.items(), key=lambda kv: -kv[1]):
                print(f"   {us:9.1f} us  {name}")


if __name__ == "__main__":
    main()
