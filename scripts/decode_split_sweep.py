"""The BEM linear at decode sizes on small matrices: the streaming decode kernel at every split of K (cluster
size), the row-split kernel (K up to 2048), the TMA kernel (its own split, then every split), the tiles kernel
and the default dispatch, against
`F.linear`; CUDA-graph GPU time per call, interleaved.

    PYTHONPATH=. python scripts/decode_split_sweep.py [--shapes 1x576x576x8,...] [--conv1d] [--only default,mma]

The default shapes are SmolLM-135M's, Qwen2-1.5B's, Llama-1B's and Phi-3-mini's at 1 and 16 tokens. Where K is
at most 2048 and N at most 4096 the default dispatch takes the row-split kernel; above, the streaming kernel on the largest cluster
that keeps at least 64 columns of K a block and runs in one wave (`decode_stream_split`). The question this
answers: which kernel, and which split, is fastest where the matrix is small?

With --conv1d the weights are stored (K, N) as GPT-2's Conv1D holds them (default shapes: GPT-2's), and the
`columns` columns are the CUDA-core transposed-weight kernel (mode 11) at its own split and each cluster size, the
`mma` ones its tensor-core form (mode 10). The `gemm, upd` and `upd, gemm` columns are cuBLAS with the update
kernel (modes 2 and 3). `--only default,mma` times those columns alone (and F.linear).
"""

from __future__ import annotations

import argparse

import torch
import torch.nn.functional as F

from bem.kernels import bench, custom_ops, ops

SCALING = 0.5
STREAM, TILES, ROWS, TMA, COLUMNS_MMA, COLUMNS = 1, 5, 8, 9, 10, 11  # linear modes: the streaming, tiles, row-split,
# TMA, and the tensor-core and CUDA-core transposed-weight decode kernels
GEMM_THEN_UPDATE, UPDATE_THEN_GEMM = 2, 3  # cuBLAS, then the update kernel adds; the update, then cuBLAS adds
SPLITS = (1, 2, 4, 8)  # the cluster sizes each kernel's `k/s` columns force


def split_names(kernel: str, own: bool = True) -> list[str]:
    """A kernel's columns: at its own split (`own`), then at each forced cluster size."""
    return ([kernel] if own else []) + [f"{kernel} k/{split}" for split in SPLITS]


def column_names(conv1d: bool) -> list[str]:
    """The table's columns after F.linear, in order."""
    if conv1d:
        return ["default", "tiles"] + split_names("columns") + split_names("mma") + ["gemm, upd", "upd, gemm"]
    return (["default", "tiles"] + split_names("stream", own=False) + ["rows", "gemm, upd", "upd, gemm"]
            + split_names("tma"))


def selected(name: str, only: tuple[str, ...]) -> bool:
    """Whether `--only`'s prefixes keep a column (all do without it)."""
    return not only or any(name.startswith(prefix) for prefix in only)


def default_shapes() -> list[tuple[int, int, int, int]]:
    smollm = [(576, 576), (576, 192), (576, 1536), (1536, 576)]
    qwen2 = [(1536, 1536), (1536, 256), (1536, 8960), (8960, 1536)]
    llama = [(2048, 2048), (2048, 512), (2048, 8192), (8192, 2048)]
    phi3 = [(3072, 9216), (3072, 3072), (3072, 16384), (8192, 3072)]
    return [(M, K, N, 8) for M in (1, 16) for K, N in smollm + qwen2 + llama + phi3]


def conv1d_shapes() -> list[tuple[int, int, int, int]]:
    gpt2 = [(768, 2304), (768, 768), (768, 3072), (3072, 768)]
    return [(M, K, N, 8) for M in (1, 4, 8, 16) for K, N in gpt2]


def sweep_row(M: int, K: int, N: int, r: int, l2_bytes: int, conv1d: bool,
              only: tuple[str, ...] = ()) -> dict[str, float]:
    sets = bench._sets(M, K, N, r, l2_bytes)
    if conv1d:  # the (N, K) view of a row-major (K, N) weight
        sets = [dict(s, W=s["W"].t().contiguous().t()) for s in sets]

    def pick(i: int) -> dict:
        return sets[i % len(sets)]

    def linear(mode: int, split: int = 0):
        return lambda i: custom_ops._C.linear_forward(
            pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(), pick(i)["c"].detach(),
            pick(i)["U"].detach(), SCALING, mode, split, False, None)

    variants = {
        "F.linear": lambda i: F.linear(pick(i)["x"], pick(i)["W"], pick(i)["b"]),
        "default": lambda i: ops.bem_linear(pick(i)["x"], pick(i)["W"], pick(i)["b"], pick(i)["V"].detach(),
                                            pick(i)["c"].detach(), pick(i)["U"].detach(), SCALING),
        "tiles": linear(TILES),
    }

    def add_splits(kernel: str, mode: int, own: bool = True) -> None:
        for name, split in zip(split_names(kernel, own), ((0,) if own else ()) + SPLITS):
            variants[name] = linear(mode, split)

    if conv1d:
        add_splits("columns", COLUMNS)
        add_splits("mma", COLUMNS_MMA)
    else:  # above its K limit the row-split kernel refuses, and is left out below
        add_splits("stream", STREAM, own=False)
        variants["rows"] = linear(ROWS)
        add_splits("tma", TMA)
    variants["gemm, upd"] = linear(GEMM_THEN_UPDATE)
    variants["upd, gemm"] = linear(UPDATE_THEN_GEMM)
    # F.linear, the ratios' denominator, always
    variants = {name: fn for name, fn in variants.items() if name == "F.linear" or selected(name, only)}
    usable = {}
    for name, fn in variants.items():  # a split the kernel refuses at this shape is left out
        try:
            with torch.no_grad():
                fn(0)
            torch.cuda.synchronize()
            usable[name] = fn
        except (RuntimeError, ValueError) as err:
            print(f"  {M}x{K}x{N}x{r} {name}: refused ({str(err).splitlines()[0][:80]})")
    with torch.no_grad():
        return bench._time_interleaved(usable, calls=max(len(sets), 16))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", help="comma-separated MxKxNxr")
    parser.add_argument("--conv1d", action="store_true", help="weights stored (K, N), as GPT-2's Conv1D")
    parser.add_argument("--only", help="comma-separated column-name prefixes to time (e.g. default,mma), F.linear always")
    args = parser.parse_args()
    shapes = bench.parse_shapes(args.shapes) if args.shapes else (conv1d_shapes() if args.conv1d
                                                                      else default_shapes())
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    bench.warm_up()
    only = tuple(args.only.split(",")) if args.only else ()
    names = [n for n in column_names(args.conv1d) if selected(n, only)]
    print(f"{'M x K x N x r':<20}{'F.linear µs':>12}" + "".join(f"{n:>12}" for n in names))
    for M, K, N, r in shapes:
        times = sweep_row(M, K, N, r, l2_bytes, args.conv1d, only)
        base = times["F.linear"]
        cells = [f"{times[n] / base:>11.2f}x" if n in times else f"{'-':>12}" for n in names]
        print(f"{f'{M}x{K}x{N}x{r}':<20}{1e3 * base:>12.2f}" + "".join(cells), flush=True)
    print("each column: its GPU time per call over F.linear's (CUDA-graph replays, inputs rotated past L2)")


if __name__ == "__main__":
    main()
