"""Benchmark of the mLSTM kernels: `python -m bem.kernels.bench --mlstm [--quick] [--json FILE]`.

In one process, interleaved, bf16, for each shape (B, NH, S, DH): SDPA causal on the same q, k, v (a
yardstick), the PyTorch formulation (parallel where its S x S matrices fit, else chunkwise), TFLA
(mlstm_kernels' chunkwise Triton kernels: "xl_chunk", or "limit_chunk" where xl_chunk dies in Triton's compiler)
when it imports, and the BEM kernels; forward and
forward+backward (CUDA-event medians, `triton.testing.do_bench`), TFLOP/s against the bf16 matmul ceiling
measured in the same run. Then the recurrent step (µs per call, eager and replayed from a CUDA graph) and
the forward's time per token from S = 8K up, which should stay flat.

FLOP counts: SDPA causal 2 B NH S² D forward (two products, half the square), 3.5x that forward+backward;
the chunkwise mLSTM with chunks of L = 64: B NH S (L (DK + DV) + 4 DK DV) forward (its causal in-chunk
products, Q C and the state update), 3x that forward+backward. Both are nominal: the ratio of times is what
compares.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable, Optional

import torch
import torch.nn.functional as F

from ..bench import ceilings, warm_up
from . import custom_ops, dispatch, reference

DTYPE = torch.bfloat16
SHAPES = [(8, 16, 2048, 64), (4, 8, 8192, 128), (1, 8, 65536, 128),
          # few (batch, head) pairs against the GPU's multiprocessors: 16-32 pairs at S from 1K to 8K
          (2, 8, 1024, 64), (2, 14, 3000, 64), (1, 16, 4096, 64), (2, 16, 8192, 64)]
SHAPES_QUICK = [(8, 16, 2048, 64), (4, 8, 8192, 128)]
LINEAR_S = (8192, 16384, 32768, 65536)
CHUNK = 64
PARALLEL_MAX_BYTES = 24 << 30  # the PyTorch parallel form's S x S float32 matrices, about 6 of them live


def _median_ms(fn: Callable[[], object], rep: int = 100) -> float:
    from triton.testing import do_bench

    return do_bench(fn, warmup=25, rep=rep, return_mode="median")


# TFLA's chunkwise kernel families (mlstm_kernels 2.x), tried in this order, each at its chunk size: xl_chunk
# (the fast one) aborts the process inside Triton 3.6's compiler (an LLVM SLPVectorizer assertion, seen on an
# H100 at chunks 64, 128 and 256); limit_chunk compiles there.
TFLA_FORMS = (("xl_chunk", "triton_xl_chunk", "mlstm_chunkwise__xl_chunk", 128),
              ("limit_chunk", "triton_limit_chunk", "mlstm_chunkwise__limit_chunk", 64))

_TFLA_PROBE = """
import importlib, sys, torch
module, name = sys.argv[1:3]
B, NH, S, D, chunk = (int(a) for a in sys.argv[3:8])
fn = getattr(importlib.import_module("mlstm_kernels.torch.chunkwise." + module), name)
q, k, v = (torch.randn(B, NH, S, D, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(3))
i, f = (torch.randn(B, NH, S, device="cuda", dtype=torch.bfloat16, requires_grad=True) for _ in range(2))
h = fn(q, k, v, i, f, chunk_size=chunk, autocast_kernel_dtype=torch.bfloat16)
torch.autograd.grad(h.float().sum(), (q, k, v, i, f))
torch.cuda.synchronize()
"""


def _tfla_missing() -> Optional[str]:
    """None when mlstm_kernels imports, else why not."""
    try:
        import mlstm_kernels.torch.chunkwise  # noqa: F401
    except Exception as error:  # not installed, or its import fails on this Triton
        return f"{type(error).__name__}: {error}"
    return None


def _tfla_form(module: str, name: str, chunk: int) -> Callable:
    import importlib

    fn = getattr(importlib.import_module("mlstm_kernels.torch.chunkwise." + module), name)

    def run(q, k, v, i, f):
        return fn(q, k, v, i, f, return_last_states=False, chunk_size=chunk, autocast_kernel_dtype=DTYPE)

    return run


def _tfla_that_runs(B, NH, S, D) -> tuple[Optional[str], Optional[Callable], str]:
    """Triton's compiler can abort the whole process on TFLA's kernels, which no try/except catches: each form
    (TFLA_FORMS, in order) is first run, forward and backward, in a child process at this shape. Returns the
    first that ran (label, function; its compiled kernels are then in Triton's cache), or None and why each
    failed. A form that failed is not tried again in this process."""
    import subprocess
    import sys

    whys = []
    for label, module, name, chunk in TFLA_FORMS:
        if label in _TFLA_FAILED:
            whys.append(f"{label}: {_TFLA_FAILED[label]}")
            continue
        try:
            done = subprocess.run([sys.executable, "-c", _TFLA_PROBE, module, name, str(B), str(NH), str(S), str(D),
                                   str(chunk)], capture_output=True, text=True, timeout=150)
            if done.returncode == 0:
                return f"TFLA {label} {chunk}", _tfla_form(module, name, chunk), "; ".join(whys)
            lines = [line for line in done.stderr.splitlines() if line.strip()]
            _TFLA_FAILED[label] = f"exit {done.returncode}: {lines[-1][:120] if lines else ''}"
        except subprocess.TimeoutExpired:
            _TFLA_FAILED[label] = "no result in 150 s"
        whys.append(f"{label}: {_TFLA_FAILED[label]}")
    return None, None, "died in a child process: " + "; ".join(whys)


_TFLA_FAILED: dict[str, str] = {}


def _inputs(B, NH, S, D, requires_grad):
    g = torch.Generator(device="cuda").manual_seed(B * 7 + S)
    q, k, v = (torch.randn(B, NH, S, D, device="cuda", generator=g, dtype=DTYPE) for _ in range(3))
    i = (torch.rand(B, NH, S, device="cuda", generator=g) * 8 - 4).to(DTYPE)
    f = (torch.rand(B, NH, S, device="cuda", generator=g) * 6 + 2).to(DTYPE)
    tensors = [q, k, v, i, f]
    return [t.requires_grad_(requires_grad) for t in tensors]


def _pytorch_form(B, NH, S):
    """The PyTorch formulation that fits: parallel where its S x S matrices do, else chunkwise."""
    if B * NH * S * S * 4 * 6 <= PARALLEL_MAX_BYTES:
        return "PyTorch parallel", lambda q, k, v, i, f: reference.mlstm_parallel(q, k, v, i, f)
    return "PyTorch chunkwise", lambda q, k, v, i, f: reference.mlstm_chunkwise(q, k, v, i, f, chunk_size=256)


def _variants(B, NH, S, tfla_label: Optional[str], tfla: Optional[Callable]) -> dict[str, Optional[Callable]]:
    name, pytorch = _pytorch_form(B, NH, S)
    return {
        "SDPA causal": lambda q, k, v, i, f: F.scaled_dot_product_attention(q, k, v, is_causal=True),
        name: pytorch,
        tfla_label or "TFLA": tfla,
        "BEM kernels": lambda q, k, v, i, f: dispatch.mlstm(q, k, v, i, f),
    }


def _flops(B, NH, S, D) -> dict[str, float]:
    sdpa = 2.0 * B * NH * S * S * D
    mlstm = float(B * NH * S) * (CHUNK * 2 * D + 4 * D * D)
    return {"sdpa_fwd": sdpa, "sdpa_fb": 3.5 * sdpa, "mlstm_fwd": mlstm, "mlstm_fb": 3.0 * mlstm}


def _time_interleaved(fns: dict[str, Callable[[], object]], rounds: int = 3) -> dict[str, object]:
    """Median of each variant's medians over `rounds` interleaved rounds; a variant that raises, or takes
    over two seconds a call after its first, is timed no further and reports why."""
    samples: dict[str, list[float]] = {name: [] for name in fns}
    failed: dict[str, str] = {}
    for round_index in range(rounds):
        for name, fn in fns.items():
            if name in failed:
                continue
            try:
                if round_index == 0:  # first use: builds, compiles, first-use checks
                    fn()
                    torch.cuda.synchronize()
                start = time.perf_counter()
                fn()
                torch.cuda.synchronize()
                if time.perf_counter() - start > 2.0:
                    samples[name].append((time.perf_counter() - start) * 1e3)
                    failed[name] = "slow: timed once"
                    continue
                samples[name].append(_median_ms(fn))
            except Exception as error:  # e.g. TFLA dying in Triton's compiler: report and go on
                failed[name] = f"{type(error).__name__}: {str(error).splitlines()[0][:120] if str(error) else ''}"
    out: dict[str, object] = {}
    for name in fns:
        values = sorted(samples[name])
        out[name] = {"ms": values[len(values) // 2] if values else None,
                     "spread": (values[-1] - values[0]) / values[len(values) // 2] if len(values) > 1 else 0.0,
                     "note": failed.get(name)}
    return out


def bench_shape(B: int, NH: int, S: int, D: int, tfla_missing: Optional[str]) -> dict:
    """One shape's table; TFLA is probed unless `tfla_missing` says why it is left out."""
    label, tfla_fn, why = _tfla_that_runs(B, NH, S, D) if tfla_missing is None else (None, None, tfla_missing)
    fwd_inputs = _inputs(B, NH, S, D, False)
    fb_inputs = _inputs(B, NH, S, D, True)
    dh = torch.randn(B, NH, S, D, device="cuda", dtype=DTYPE)
    variants = _variants(B, NH, S, label, tfla_fn)

    def forward(fn):
        def run():
            with torch.no_grad():
                return fn(*fwd_inputs)
        return run

    def forward_backward(fn):
        def run():
            out = fn(*fb_inputs)
            return torch.autograd.grad(out, fb_inputs[:3] if fn is variants["SDPA causal"] else fb_inputs, dh)
        return run

    fwd = _time_interleaved({name: forward(fn) for name, fn in variants.items() if fn is not None})
    fb = _time_interleaved({name: forward_backward(fn) for name, fn in variants.items() if fn is not None})
    for name, fn in variants.items():
        if fn is None:
            fwd[name] = fb[name] = {"ms": None, "spread": 0.0, "note": why}
    if tfla_fn is not None and why:  # an earlier form died: say so beside the one that ran
        fwd[label]["note"] = "; ".join(n for n in (fwd[label]["note"], why) if n)
    torch.cuda.empty_cache()
    return {"shape": {"B": B, "NH": NH, "S": S, "D": D}, "forward": fwd, "forward_backward": fb,
            "flops": _flops(B, NH, S, D)}


def bench_step(B: int = 1, NH: int = 8, D: int = 128, calls: int = 200) -> dict:
    q, k, v, i, f = (t[:, :, 0].contiguous() for t in _inputs(B, NH, 1, D, False))
    state = reference.zero_state(B, NH, D, D, device="cuda")
    results = {}
    with torch.no_grad():
        for name, use_fused in (("BEM step kernel", True), ("PyTorch step", False)):
            st = state
            for _ in range(10):
                _, st = dispatch.mlstm_step(q, k, v, i, f, st, use_fused=use_fused)
            torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(calls):
                _, st = dispatch.mlstm_step(q, k, v, i, f, st, use_fused=use_fused)
            torch.cuda.synchronize()
            results[f"{name}, eager (us/call)"] = (time.perf_counter() - start) / calls * 1e6
        steps = 50
        static_state = [t.clone() for t in state]
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            dispatch.mlstm_step(q, k, v, i, f, static_state)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            st = static_state
            for _ in range(steps):
                _, st = dispatch.mlstm_step(q, k, v, i, f, st)
        results["BEM step kernel, CUDA graph (us/step)"] = _median_ms(graph.replay) * 1e3 / steps
    return results


def bench_linear(D: int = 128, NH: int = 8) -> dict[int, float]:
    """The kernels' forward at B = 1 from S = 8K: µs per 1K tokens (flat when time is linear in S)."""
    out = {}
    for S in LINEAR_S:
        q, k, v, i, f = _inputs(1, NH, S, D, False)
        with torch.no_grad():
            ms = _median_ms(lambda: dispatch.mlstm(q, k, v, i, f))
        out[S] = ms * 1e3 / (S / 1024)
        del q, k, v, i, f
        torch.cuda.empty_cache()
    return out


def _cell(entry: dict, flops: float, mm: float) -> str:
    if entry["ms"] is None:
        return f"{'-':>9}{'':>7}{'':>6}"
    tflops = flops / entry["ms"] / 1e9
    return f"{entry['ms']:>9.3f}{tflops:>7.1f}{100 * tflops / mm:>5.1f}%"


def format_table(result: dict, mm_tflops: float) -> str:
    s = result["shape"]
    fl = result["flops"]
    sdpa_f = result["forward"]["SDPA causal"]["ms"]
    sdpa_b = result["forward_backward"]["SDPA causal"]["ms"]
    lines = [f"B={s['B']} NH={s['NH']} S={s['S']} DH={s['D']}",
             f"  {'variant':<20}{'fwd ms':>9}{'TF/s':>7}{'%mm':>6}{'x SDPA':>8}{'fwd+bwd ms':>11}{'TF/s':>7}{'%mm':>6}"
             f"{'x SDPA':>8}  notes"]
    for name in result["forward"]:
        f_entry, b_entry = result["forward"][name], result["forward_backward"][name]
        kind = "sdpa" if name == "SDPA causal" else "mlstm"
        ratio_f = f"{f_entry['ms'] / sdpa_f:>8.2f}" if f_entry["ms"] and sdpa_f else f"{'-':>8}"
        ratio_b = f"{b_entry['ms'] / sdpa_b:>8.2f}" if b_entry["ms"] and sdpa_b else f"{'-':>8}"
        notes = "; ".join(n for n in (f_entry["note"], b_entry["note"]) if n)
        lines.append(f"  {name:<20}{_cell(f_entry, fl[kind + '_fwd'], mm_tflops)}{ratio_f}"
                     f"{_cell(b_entry, fl[kind + '_fb'], mm_tflops):>24}{ratio_b}  {notes}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the two smaller shapes, no linearity sweep")
    parser.add_argument("--no-tfla", action="store_true", help="leave TFLA out (its first compile takes minutes)")
    parser.add_argument("--json", help="write every number to this file")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or custom_ops.extension() is None:
        raise SystemExit("the mLSTM benchmark needs a CUDA GPU and the mLSTM kernels (see mlstm_unavailable_reason)")
    props = torch.cuda.get_device_properties(0)
    warm_up()
    ceil = ceilings()
    header = (f"{props.name}, torch {torch.__version__}, bf16; matmul {ceil['bf16_TFLOPs']:.0f} TFLOP/s, "
              f"copy {ceil['copy_GBps']:.0f} GB/s (read+write)")
    print(header, flush=True)
    why = "left out (--no-tfla)" if args.no_tfla else _tfla_missing()
    if why is not None:
        print(f"TFLA not importable: {why}", flush=True)
    results = []
    for B, NH, S, D in SHAPES_QUICK if args.quick else SHAPES:
        result = bench_shape(B, NH, S, D, why)
        results.append(result)
        print(format_table(result, ceil["bf16_TFLOPs"]), flush=True)
    step = bench_step()
    linear = {} if args.quick else bench_linear()
    print("Recurrent step, B=1 NH=8 DH=128: " + ", ".join(f"{k} {v:.1f}" for k, v in step.items()))
    if linear:
        print("Forward, B=1 NH=8 DH=128, us per 1K tokens: " + ", ".join(f"S={S}: {v:.1f}" for S, v in linear.items()))
    print(header)
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": props.name, "ceilings": ceil, "results": results, "step": step,
                       "linear_us_per_1k": linear, "tfla": why or "ok"}, f, indent=1)
