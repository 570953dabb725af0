"""The decode kernels' error against float64 over many draws of the codes, beside PyTorch's in the same dtype:
the tail of the ratio, which a test's handful of draws samples only by luck.

    PYTHONPATH=. python scripts/decode_error_probe.py [--draws 300]

For each kernel (linear mode and split of K) and shape: the largest and the 99th-percentile ratio of the
kernel's relative error to PyTorch's (floored at one rounding of the output, as the tests' bound is), and how
many draws exceed the tests' bound of 2.
"""

from __future__ import annotations

import argparse

import torch

from bem.kernels import custom_ops, reference

SCALING = 1.5
KERNELS = [("stream", 1, 0), ("stream", 1, 2), ("stream", 1, 8), ("tiles", 5, 0), ("tiles", 5, 4),
           ("rows", 8, 0), ("tma", 9, 0), ("tma", 9, 4)]
SHAPES = [(1, 4096, 4096, 8), (16, 4096, 4096, 8), (1, 2048, 8192, 16), (4, 1536, 1536, 8)]


def rel_err(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref).norm() / ref.norm()).item()


def operands(M: int, K: int, N: int, r: int, seed: int, draws: int, dtype: torch.dtype = torch.bfloat16):
    """(x, W, b, V, U, [codes] * draws), drawn in that generator's order from `seed`, scaled as a layer's."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    V = (torch.randn(K, r, device="cuda", generator=g) / K**0.5).to(dtype)
    U = torch.randn(N, r, device="cuda", generator=g).to(dtype)
    W = (torch.randn(N, K, device="cuda", generator=g) / K**0.5).to(dtype)
    b = torch.randn(N, device="cuda", generator=g).to(dtype)
    codes = [torch.randn(M, r, device="cuda", generator=g).to(dtype) for _ in range(draws)]
    return x, W, b, V, U, codes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draws", type=int, default=300)
    args = parser.parse_args()
    _C = custom_ops.extension()
    dtype = torch.bfloat16
    floor = torch.finfo(dtype).eps / 2
    print(f"{'kernel':<12}{'M x K x N x r':<18}{'max':>7}{'p99':>7}{'median':>8}{'> 2':>5}  worst kernel / torch err")
    for M, K, N, r in SHAPES:
        x, W, b, V, U, draws = operands(M, K, N, r, M * 7 + K + N + r, args.draws, dtype)
        refs = [reference.bem_linear(x.double(), W.double(), b.double(), V.double(), c.double(), U.double(), SCALING)
                for c in draws]
        torch_errs = [rel_err(reference.bem_linear(x, W, b, V, c, U, SCALING), ref) for c, ref in zip(draws, refs)]
        for name, mode, split in KERNELS:
            try:
                outs = [_C.linear_forward(x, W, b, V, c, U, SCALING, mode, split, False)[0] for c in draws]
            except (RuntimeError, ValueError) as err:
                print(f"{name + ' k/' + str(split):<12}{f'{M}x{K}x{N}x{r}':<18} refused: {str(err).splitlines()[0][:70]}")
                continue
            ratios = sorted(rel_err(o, ref) / max(t, floor) for o, ref, t in zip(outs, refs, torch_errs))
            worst = max(range(len(outs)), key=lambda i: rel_err(outs[i], refs[i]) / max(torch_errs[i], floor))
            print(f"{name + ' k/' + str(split):<12}{f'{M}x{K}x{N}x{r}':<18}{ratios[-1]:>7.2f}"
                  f"{ratios[int(0.99 * (len(ratios) - 1))]:>7.2f}{ratios[len(ratios) // 2]:>8.2f}"
                  f"{sum(q > 2 for q in ratios):>5}  {rel_err(outs[worst], refs[worst]):.4f} / {torch_errs[worst]:.4f}",
                  flush=True)


if __name__ == "__main__":
    main()
