"""Forward of the BEM linear at a few hundred to a few thousand rows, every composition in one process:
`F.linear`, the default dispatch, linear modes 2 and 3 (cuBLAS beside a separate update), mode 6 (the
GEMM with the update inside) and mode 7 (that GEMM given s (x V) ⊙ codes from cuBLAS and the scaling
kernel), each with 128- and 256-column tiles; ratios to `F.linear`, CUDA-graph GPU time.

    PYTHONPATH=. python scripts/linear_mode_sweep.py [--shapes 512x4096x4096x8,...] [--conv1d]

Without --shapes: M in 128..2048 over the square and the MLP shapes of 4096- and 2048-wide models; with
--conv1d (weights stored as GPT-2's Conv1D stores them, a row-major (K, N) tensor read transposed), M in
512..16384 over GPT-2's and GPT-2 medium's shapes.
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bem.kernels import bench, custom_ops, ops

SCALING = 0.5


def default_shapes() -> list[tuple[int, int, int, int]]:
    shapes = []
    for M in (128, 256, 512, 1024, 2048):
        shapes += [(M, 4096, 4096, r) for r in (8, 16, 32, 64)]
        for K, N in ((4096, 14336), (14336, 4096), (2048, 2048), (2048, 8192), (8192, 2048)):
            shapes += [(M, K, N, r) for r in (8, 32)]
    return shapes


def conv1d_shapes() -> list[tuple[int, int, int, int]]:
    return [(M, K, N, r) for M in (512, 1024, 4096, 16384)
            for K, N in ((768, 768), (768, 2304), (768, 3072), (3072, 768), (1024, 4096), (4096, 1024))
            for r in (8, 32)]


def sweep_row(M: int, K: int, N: int, r: int, l2_bytes: int, conv1d: bool = False) -> dict[str, float]:
    sets = bench._sets(M, K, N, r, l2_bytes)
    if conv1d:  # the (N, K) view of a row-major (K, N) tensor
        for s in sets:
            s["W"] = s["W"].t().contiguous().t()

    def pick(i: int) -> dict:
        return sets[i % len(sets)]

    def linear(mode: int, tile_n: int = 0):
        return lambda i: custom_ops._C.linear_forward(
            pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(), pick(i)["c"].detach(),
            pick(i)["U"].detach(), SCALING, mode, 0, False, None, tile_n)

    variants = {
        "F.linear": lambda i: F.linear(pick(i)["x"], pick(i)["W"], pick(i)["b"]),
        "default": lambda i: ops.bem_linear(pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(),
                                            pick(i)["c"].detach(), pick(i)["U"].detach(), SCALING),
        "mode 2": linear(2),
        "mode 3": linear(3),
        "mode 6 t256": linear(6, 256),
        "mode 6 t128": linear(6, 128),
        "mode 7 t256": linear(7, 256),
        "mode 7 t128": linear(7, 128),
    }
    with torch.no_grad():
        return bench._time_interleaved(variants, calls=20)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", help="comma-separated MxKxNxR")
    parser.add_argument("--conv1d", action="store_true", help="weights stored as GPT-2's Conv1D stores them")
    args = parser.parse_args()
    shapes = ([tuple(int(v) for v in s.split("x")) for s in args.shapes.split(",")] if args.shapes
              else conv1d_shapes() if args.conv1d else default_shapes())
    bench.warm_up()
    props = torch.cuda.get_device_properties(0)
    names = ("default", "mode 2", "mode 3", "mode 6 t256", "mode 6 t128", "mode 7 t256", "mode 7 t128")
    layout = "Conv1D weights (row-major K x N, read transposed)" if args.conv1d else "row-major weights"
    print(f"{props.name}, {props.multi_processor_count} multiprocessors; {layout}; x F.linear")
    print(f"{'M':>6}{'K':>7}{'N':>7}{'r':>4}{'tiles256':>9}{'tiles128':>9}{'F.lin us':>9}"
          + "".join(f"{n:>12}" for n in names), flush=True)
    for M, K, N, r in shapes:
        t = sweep_row(M, K, N, r, props.L2_cache_size, args.conv1d)
        tiles = [-(-M // 128) * -(-N // width) for width in (256, 128)]
        print(f"{M:>6}{K:>7}{N:>7}{r:>4}{tiles[0]:>9}{tiles[1]:>9}{t['F.linear'] * 1e3:>9.1f}"
              + "".join(f"{t[n] / t['F.linear']:>12.2f}" for n in names), flush=True)


if __name__ == "__main__":
    main()
