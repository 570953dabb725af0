"""How torch.compile treats the joint form's expand, by how it is written: a decoder stack's device time per step.

    python scripts/expand_forms.py [--shapes llama_1b,smollm_135m] [--batch 1,16] [--forms base,fused,mm] [--code DIR]

generate's compiled step computes each wrapped layer as `z = x [W; Vᵀ]ᵀ` (one GEMM for the layers that share an
input) and then the expand `out = z[:, rows] + s ((z[:, h] ⊙ c) Uᵀ)`; inductor fuses the expand into whatever
kernel consumes `out`. Where that consumer is a reduction (the RMSNorm after a residual add), a single row at
batch 1 puts the whole expand in one thread block. This script compiles a stack of decoder-shaped layers (the
attention replaced by a pointwise stand-in: q scaled, plus k's and v's means) with CUDA graphs
(`mode="reduce-overhead"`) for each way of writing the expand, and prints the device time of one call (CUDA
events over replays, median of rounds) and, per form, the kernels the profiler sees (compiling takes 10-30 s a
form and shape):

- `base`: the frozen layers alone (plain `F.linear`, no update): the denominator;
- `fused`: r multiply-adds written out, as `joint_linear` writes them (fused into the consumer);
- `reduce`: `((h ⊙ c) U)` as a sum over r of a broadcast product (inductor unrolls a sum of at most 8 terms);
- `mm`: `(h ⊙ c) @ Uᵀ` (a GEMM of inner size r, an extern call);
- `fused-mm`: `fused` for the layers of a group (pointwise consumers), `mm` for the layers alone (o, down: the
  residual add and the next norm's reduction), as `joint_linear` writes them.
`--code DIR` writes inductor's generated code for each form and batch there.
"""

from __future__ import annotations

import argparse
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F

SHAPES = {  # hidden, q heads x head dim, kv heads, FFN, layers
    "llama_1b": (2048, 32, 64, 8, 8192, 16),
    "smollm_135m": (576, 9, 64, 3, 1536, 30),
    "qwen2_1.5b": (1536, 12, 128, 2, 8960, 28),
}
FORMS = ("base", "fused", "reduce", "mm", "fused-mm")
RANK = 8


def rms(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    variance = x.float().pow(2).mean(-1, keepdim=True)
    return (x.float() * torch.rsqrt(variance + 1e-6)).to(x.dtype) * w


def expand(form: str, z: torch.Tensor, start: int, rows: int, h_start: int, codes: torch.Tensor, U: torch.Tensor,
           scaling: float) -> torch.Tensor:
    h = z[..., h_start:h_start + RANK] * codes * scaling
    out = z[..., start:start + rows]
    if form == "fused":
        for j in range(RANK):
            out = out + h[..., j:j + 1] * U[:, j]
        return out
    if form == "reduce":
        return out + (h.unsqueeze(-2) * U).sum(-1)
    if form == "mm":
        return out + h @ U.t()
    raise ValueError(form)


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
        s = 2.0
        for i, p in enumerate(self.layers):
            c = codes[i]
            U = p["U"]
            a = rms(h, p["n1"])
            if form == "base":
                z = F.linear(a, p["qkv"][:nq + 2 * nkv])
                q, k, v = z[..., :nq], z[..., nq:nq + nkv], z[..., nq + nkv:nq + 2 * nkv]
            else:
                z = F.linear(a, p["qkv"])
                pointwise = "fused" if form == "fused-mm" else form
                q = expand(pointwise, z, 0, nq, nq + 2 * nkv, c, U[0], s)
                k = expand(pointwise, z, nq, nkv, nq + 2 * nkv + RANK, c, U[1], s)
                v = expand(pointwise, z, nq + nkv, nkv, nq + 2 * nkv + 2 * RANK, c, U[2], s)
            attn = q * 0.5 + (k.float().mean(-1, keepdim=True) + v.float().mean(-1, keepdim=True)).to(q.dtype)
            reduction = "mm" if form == "fused-mm" else form
            if form == "base":
                o = F.linear(attn, p["o"][:hidden])
            else:
                o = expand(reduction, F.linear(attn, p["o"]), 0, hidden, hidden, c, U[3], s)
            h = h + o
            a = rms(h, p["n2"])
            if form == "base":
                z = F.linear(a, p["gu"][:2 * ffn])
                gate, up = z[..., :ffn], z[..., ffn:2 * ffn]
            else:
                z = F.linear(a, p["gu"])
                pointwise = "fused" if form == "fused-mm" else form
                gate = expand(pointwise, z, 0, ffn, 2 * ffn, c, U[4], s)
                up = expand(pointwise, z, ffn, ffn, 2 * ffn + RANK, c, U[5], s)
            m = F.silu(gate) * up
            if form == "base":
                d = F.linear(m, p["d"][:hidden])
            else:
                d = expand(reduction, F.linear(m, p["d"]), 0, hidden, hidden, c, U[6], s)
            h = h + d
        return rms(h, self.layers[0]["n1"])


def kernels(fn, calls: int = 20) -> list[tuple[str, float, int]]:
    """(name, device µs per call, launches per call) of the kernels `fn` runs."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(calls):
            fn()
        torch.cuda.synchronize()
    rows = [(e.key, e.device_time_total / calls, e.count // calls) for e in prof.key_averages()
            if e.device_time_total > 0]
    return sorted(rows, key=lambda row: -row[1])


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
                listed = kernels(lambda form=form: steps[form](h, codes))
                table.append((name, batch, form, us, us / base if base else float("nan"),
                              sum(n for _, _, n in listed)))
                print(f"{name} b{batch} {form}: {us:.1f} µs a call, x{table[-1][4]:.3f}, {table[-1][5]} kernels", flush=True)
                for kernel, micros, count in listed[:12]:
                    print(f"    {micros:8.1f} µs {count:4d}x  {kernel[:110]}")
    print(f"\n{torch.cuda.get_device_name()}, torch {torch.__version__}; device µs a call of the compiled stack "
          f"(CUDA graphs), median of {args.rounds} rounds of 50")
    print(f"{'shape':<14}{'batch':>6}  {'form':<16}{'µs':>9}{'x base':>8}{'kernels':>9}")
    for name, batch, form, us, ratio, count in table:
        print(f"{name:<14}{batch:>6}  {form:<16}{us:>9.1f}{ratio:>8.3f}{count:>9}")


if __name__ == "__main__":
    main()
