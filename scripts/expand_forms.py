"""How torch.compile treats the joint form's expand, by how it is written: a decoder stack's device time per step.

    PYTHONPATH=. python scripts/expand_forms.py [--shapes llama_1b,...] [--batch 1,16] [--forms ...] [--code DIR]

generate's compiled step computes each wrapped layer as `z = x [W; Vᵀ]ᵀ` (one GEMM for the layers that share an
input) and then the expand `out = z[:, rows] + s ((z[:, h] ⊙ c) Uᵀ)`; inductor fuses the expand into whatever
kernel consumes `out`. Where that consumer is a reduction (the RMSNorm after a residual add), a single row at
batch 1 puts the whole expand in one thread block. This script compiles a stack of decoder-shaped layers (the
attention replaced by a pointwise stand-in: q scaled, plus k's and v's means) with CUDA graphs
(`mode="reduce-overhead"`) for each way of writing the expand, and prints the device time of one call (CUDA
events over replays, median of rounds) and, per form, the kernels the profiler sees (compiling takes 10-30 s a
form and shape):

- `base`: the frozen layers alone (each its own `F.linear`, no update): the denominator;
- `fused`: every expand as r multiply-adds written out (`JointSlot.apart` False), fused into its consumer;
- `mm`: every expand as `(h ⊙ c) @ Uᵀ` (a GEMM of inner size r, an extern call);
- `fused-mm`: `fused` for the layers of a group (pointwise consumers), `mm` for the layers alone (o, down: the
  residual add and the next norm's reduction): what generate's compiled step does.
Each BEM form calls `joint_linear` on `JointSlot`s laid out as `JointWeights` lays them out. (Written as a sum
over r of a broadcast product, the expand becomes the multiply-adds again: inductor unrolls sums of at most 8.)
`--code DIR` writes inductor's generated code for each form and batch there.
"""

from __future__ import annotations

import argparse
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))
from compiled_decode_breakdown import kernel_times  # noqa: E402

from bem.modules.joint_weights import JointSlot, joint_linear  # noqa: E402

SHAPES = {  # hidden, q heads x head dim, kv heads, FFN, layers
    "llama_1b": (2048, 32, 64, 8, 8192, 16),
    "smollm_135m": (576, 9, 64, 3, 1536, 30),
    "qwen2_1.5b": (1536, 12, 128, 2, 8960, 28),
}
# each BEM form: (`apart` of a group's layers, `apart` of a layer alone)
APART = {"fused": (False, False), "mm": (True, True), "fused-mm": (False, True)}
FORMS = ("base", *APART)
RANK = 8
SCALING = 2.0


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype) * w


class Stack(torch.nn.Module):
    def __init__(self, shape: tuple, device: torch.device, dtype: torch.dtype) -> None:
        super().__init__()
        hidden, heads, head_dim, kv_heads, ffn, layers = shape
        self.dims = (hidden, heads * head_dim, kv_heads * head_dim, ffn)
        nq, nkv = heads * head_dim, kv_heads * head_dim
        g = torch.Generator(device="cpu").manual_seed(0)

        def rand(*size: int) -> torch.Tensor:
            return (torch.randn(*size, generator=g) * size[-1] ** -0.5).to(device, dtype)

        pad = -(-3 * RANK // 8) * 8
        self.layers = []
        for _ in range(layers):
            self.layers.append({
                "n1": torch.ones(hidden, device=device, dtype=dtype), "n2": torch.ones(hidden, device=device, dtype=dtype),
                "qkv": rand(nq + 2 * nkv + pad, hidden), "o": rand(hidden + 8, nq), "gu": rand(2 * ffn + 16, hidden),
                "d": rand(hidden + 8, ffn), "U": [rand(n, RANK) for n in (nq, nkv, nkv, hidden, ffn, ffn, hidden)]})
        for layer in self.layers:  # fixed addresses: CUDA-graph replays read them in place
            for value in layer.values():
                for tensor in value if isinstance(value, list) else [value]:
                    torch._dynamo.mark_static_address(tensor)

    def forward(self, h: torch.Tensor, codes: torch.Tensor, form: str) -> torch.Tensor:
        hidden, nq, nkv, ffn = self.dims
        grouped, alone = APART.get(form, (False, False))
        memo: dict = {}  # the groups' products of this call, as generate's compiled step keeps them
        for i, p in enumerate(self.layers):
            c, U = codes[i], p["U"]

            def layer(x, buffer, group, start, rows, h_start, apart, j):
                """One wrapped layer: the frozen rows of `buffer` alone (base) or `joint_linear` (BEM)."""
                if form == "base":
                    return F.linear(x, buffer[start:start + rows])
                slot = JointSlot(buffer, 4 * i + group, start, rows, h_start, None, memo, apart)
                return joint_linear(x, slot, c, U[j], SCALING)

            a = rms(h, p["n1"])
            q = layer(a, p["qkv"], 0, 0, nq, nq + 2 * nkv, grouped, 0)
            k = layer(a, p["qkv"], 0, nq, nkv, nq + 2 * nkv + RANK, grouped, 1)
            v = layer(a, p["qkv"], 0, nq + nkv, nkv, nq + 2 * nkv + 2 * RANK, grouped, 2)
            attn = q * 0.5 + (k.float().mean(-1, keepdim=True) + v.float().mean(-1, keepdim=True)).to(q.dtype)
            h = h + layer(attn, p["o"], 1, 0, hidden, hidden, alone, 3)
            a = rms(h, p["n2"])
            gate = layer(a, p["gu"], 2, 0, ffn, 2 * ffn, grouped, 4)
            up = layer(a, p["gu"], 2, ffn, ffn, 2 * ffn + RANK, grouped, 5)
            h = h + layer(F.silu(gate) * up, p["d"], 3, 0, hidden, hidden, alone, 6)
        return rms(h, self.layers[0]["n1"])


def kernels(fn, device: torch.device, calls: int = 20) -> tuple[dict[str, float], float]:
    """(device µs per call by kernel name, kernels per call) of `fn`."""
    _, count, by_name = kernel_times(lambda _index: [fn() for _ in range(calls)], 0, device)
    return {name: micros / calls for name, micros in by_name.items()}, sum(count.values()) / calls


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shapes", default="llama_1b")
    parser.add_argument("--batch", default="1")
    parser.add_argument("--forms", default=",".join(FORMS))
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--code")
    args = parser.parse_args()
    device, dtype = torch.device("cuda"), torch.bfloat16
    forms = args.forms.split(",")
    table = []
    for name in args.shapes.split(","):
        stack = Stack(SHAPES[name], device, dtype)
        layers, hidden = len(stack.layers), stack.dims[0]
        for batch in (int(b) for b in args.batch.split(",")):
            h = torch.randn(batch, hidden, device=device, dtype=dtype)
            codes = torch.rand(layers, batch, RANK, device=device, dtype=dtype) + 0.5
            steps = {}
            for form in forms:
                torch._dynamo.reset()
                compiled = torch.compile(lambda h, c, form=form: stack(h, c, form), mode="reduce-overhead",
                                         fullgraph=True)
                if args.code:
                    from torch._inductor.utils import run_and_get_code

                    _, sources = run_and_get_code(compiled, h, codes)
                    path = Path(args.code) / f"{name}_b{batch}_{form}.py"
                    path.parent.mkdir(parents=True, exist_ok=True)
                    path.write_text("\n\n".join(sources))
                for _ in range(5):
                    compiled(h, codes)
                torch.cuda.synchronize()
                steps[form] = compiled
            times: dict[str, list[float]] = {form: [] for form in forms}
            for _ in range(args.rounds):
                for form in forms:
                    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                    start.record()
                    for _ in range(50):
                        steps[form](h, codes)
                    end.record()
                    end.synchronize()
                    times[form].append(1e3 * start.elapsed_time(end) / 50)
            base = statistics.median(times["base"]) if "base" in times else None
            for form in forms:
                us = statistics.median(times[form])
                by_name, launches = kernels(lambda form=form: steps[form](h, codes), device)
                table.append((name, batch, form, us, us / base if base else float("nan"), launches))
                print(f"{name} b{batch} {form}: {us:.1f} µs a call, x{table[-1][4]:.3f}, {launches:.0f} kernels",
                      flush=True)
                for kernel, micros in sorted(by_name.items(), key=lambda item: -item[1])[:12]:
                    print(f"    {micros:8.1f} µs  {kernel[:110]}")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; device µs a call of the compiled stack "
          f"(CUDA graphs), median of {args.rounds} rounds of 50")
    print(f"{'shape':<14}{'batch':>6}  {'form':<16}{'µs':>9}{'x base':>8}{'kernels':>9}")
    for name, batch, form, us, ratio, count in table:
        print(f"{name:<14}{batch:>6}  {form:<16}{us:>9.1f}{ratio:>8.3f}{count:>9.0f}")


if __name__ == "__main__":
    main()
