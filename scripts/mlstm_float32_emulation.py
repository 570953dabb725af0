"""The mLSTM forward kernels (bem/kernels/csrc/mlstm/mlstm_states.cu, mlstm_outputs in mlstm_forward.cu) emulated in
float32 with numpy, each sum in the CUDA code's order and rounding (FMA: one rounding per step), to find
where their float32 error against the float64 reference comes from. No GPU needed.

    python scripts/mlstm_float32_emulation.py [--draws N] [--float-scan] [--float-log-weights] [--exact-division]
        [--inputs FILE] [--backward]

Prints, per draw of the GPU test's distributions (B 2, NH 3, S 100, 64 x 64, an initial state), the
relative error in h of PyTorch's parallel form in float32 and of the emulated kernels. --float-scan
emulates the gates' scan in float32 (as the kernels did before they scanned float32 inputs in double);
--float-log-weights rounds the scanned g, a and pm to float32 and forms the log weights (a_s - M_t, m - M) in
float32, as the kernels did before they kept them in double. --inputs takes the operands from a file
(torch.save of [q, k, v, igate, fgate, C0, n0, m0], CPU tensors, e.g. the GPU test's own draw).

--backward instead runs the backward's PyTorch transcription (`bem/kernels/mlstm/backward.py`, the kernels'
maths in their order) in float32 on the backward test's shape (B 2, NH 2, S 70, DK 100, DV 64), with the
gates scanned as the kernels scan them (in double, or with --float-scan in float32), and prints each
gradient's error over the PyTorch parallel form's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))
from bem.kernels.mlstm import reference  # noqa: E402
from gpu.kernel_helpers import rel_err  # noqa: E402

f32 = np.float32
L = 64
EXACT: set[str] = set()


def logsig(x):  # through double, rounded once
    x = x.astype(np.float64)
    return (np.minimum(x, 0) - np.log1p(np.exp(-np.abs(x)))).astype(f32)

def fexp(x):
    with np.errstate(over='ignore'):
        return np.exp(x.astype(np.float64)).astype(f32)

def chunk_gates(lf, ig, S, c):
    # lf, ig: float32 arrays (S,); returns g, a, pm (64,) float32 per the warp scan
    t = np.arange(c * L, c * L + L)
    lfc = np.where(t < S, lf[np.minimum(t, S - 1)], f32(0)).astype(f32)
    igc = np.where(t < S, ig[np.minimum(t, S - 1)], f32(-np.inf)).astype(f32)
    lf0, lf1 = lfc[0::2], lfc[1::2]
    pair = (lf0 + lf1).astype(f32)
    incl = pair.copy()
    o = 1
    while o < 32:
        y = np.concatenate([np.zeros(o, f32), incl[:-o]])
        incl = np.where(np.arange(32) >= o, (incl + y).astype(f32), incl)
        o <<= 1
    before = np.concatenate([[f32(0)], incl[:-1]]).astype(f32)
    g0 = (before + lf0).astype(f32); g1 = incl
    a0 = (igc[0::2] - g0).astype(f32); a1 = (igc[1::2] - g1).astype(f32)
    g = np.empty(L, f32); a = np.empty(L, f32)
    g[0::2], g[1::2], a[0::2], a[1::2] = g0, g1, a0, a1
    if "float-scan" not in EXACT:  # the kernels' scan of float32 inputs: in double
        cumulative = np.cumsum(lfc.astype(np.float64))
        g = cumulative
        a = igc.astype(np.float64) - cumulative
        if "float-log-weights" in EXACT:  # rounded to float32 once (the kernels before they kept them in double)
            g, a = g.astype(f32), a.astype(f32)
    pm = np.maximum.accumulate(a)
    return g, a, pm  # float64 unless --float-scan or --float-log-weights

def seqdot(A, B):
    """A (m, k) @ B (k, n) with a sequential float32 FMA over k (FMA: one rounding per step)."""
    acc = np.zeros((A.shape[0], B.shape[1]), f32)
    for k in range(A.shape[1]):
        acc = (acc.astype(np.float64) + np.outer(A[:, k], B[k]).astype(np.float64)).astype(f32)
    return acc

def forward_row(q, k, v, ig, fg, C0, n0, m0, scale):
    S, DK = q.shape; DV = v.shape[1]
    NC = -(-S // L)
    lf = logsig(fg)
    # states kernel
    acc = C0.astype(f32).copy(); n = n0.astype(f32).copy(); m = f32(m0)
    Cs, ns, ms = [], [], []
    n_decay = f32(0); parts = None
    for c in range(NC):
        if c > 0:
            n = (n_decay * n + parts[0] + parts[1]).astype(f32)  # left to right: (d*n + p0) + p1
        Cs.append(acc.copy()); ns.append(n.copy()); ms.append(m)
        g, a, pm = chunk_gates(lf, ig, S, c)
        M = max(np.asarray(m, pm.dtype), pm[-1])  # in the gates' type: double, float32 with the flags
        w = fexp(a - M)
        decay = fexp(np.array(m - M))[()]
        m_next = f32(g[-1] + M)
        rows = np.arange(c * L, c * L + L)
        kk = np.where((rows < S)[:, None], k[np.minimum(rows, S - 1)], 0).astype(f32)
        vv = np.where((rows < S)[:, None], v[np.minimum(rows, S - 1)], 0).astype(f32)
        x = (vv * w[:, None]).astype(f32)
        acc = (acc * decay).astype(f32)
        for r in range(L):  # FMA over tokens
            acc = (acc.astype(np.float64) + np.outer(kk[r], x[r])).astype(f32)
        p0 = np.zeros(DK, f32); p1 = np.zeros(DK, f32)
        for r in range(32):
            p0 = (p0 + (w[r] * kk[r]).astype(f32)).astype(f32)
        for r in range(32, 64):
            p1 = (p1 + (w[r] * kk[r]).astype(f32)).astype(f32)
        parts = (p0, p1); n_decay = decay; m = m_next
    # outputs kernel
    h = np.zeros((S, DV), f32)
    for c in range(NC):
        g, a, pm = chunk_gates(lf, ig, S, c)
        C, nc, mc = Cs[c], ns[c], ms[c]
        rows = np.arange(c * L, c * L + L)
        valid = rows < S
        qq = np.where(valid[:, None], q[np.minimum(rows, S - 1)], 0).astype(f32)
        kk = np.where(valid[:, None], k[np.minimum(rows, S - 1)], 0).astype(f32)
        vv = np.where(valid[:, None], v[np.minimum(rows, S - 1)], 0).astype(f32)
        s_acc = seqdot(qq, kk.T)
        h_acc = seqdot(qq, C)
        qn = np.zeros(L, f32); qn2 = np.zeros(L, f32)
        for j in range(32):
            qn = (qn + qq[:, j] * nc[j]).astype(f32)
            qn2 = (qn2 + qq[:, 32 + j] * nc[32 + j]).astype(f32)
        qn = (qn + qn2).astype(f32)
        M = np.maximum(np.asarray(mc, pm.dtype), pm)
        inter = (fexp(mc - M) * f32(scale)).astype(f32)
        tri = np.tril(np.ones((L, L), bool))
        W = np.where(tri, (s_acc * f32(scale)).astype(f32) * fexp(a[None, :] - M[:, None]), f32(0)).astype(f32)
        # row sums: each lane owns columns 8nt + 2c + {0,1}; partial over nt, e; then xor 1, xor 2
        lanes = []
        for cc in range(4):
            ssum = np.zeros(L, f32)
            for nt in range(8):
                for e in range(2):
                    ssum = (ssum + W[:, 8 * nt + 2 * cc + e]).astype(f32)
            lanes.append(ssum)
        x1 = [(lanes[i] + lanes[i ^ 1]).astype(f32) for i in range(4)]
        x2 = [(x1[i] + x1[i ^ 2]).astype(f32) for i in range(4)]
        row_sum = x2[0]
        h_acc = (h_acc * inter[:, None]).astype(f32)
        for s in range(L):
            h_acc = (h_acc.astype(np.float64) + np.outer(W[:, s], vv[s])).astype(f32)
        den = (inter * qn + row_sum).astype(f32)
        m_t = (g + M).astype(f32)
        nrm = np.maximum(np.abs(den), fexp(-m_t)).astype(f32)
        inv = (f32(1) / nrm).astype(f32)
        out = (h_acc * inv[:, None]).astype(f32)
        if "division" in EXACT:
            out = (h_acc.astype(np.float64) / nrm[:, None]).astype(f32)
        h[rows[valid]] = out[valid]
    return h

def draw(B, NH, S, DK, DV, seed):
    g = torch.Generator().manual_seed(seed)
    d = lambda *s: torch.randn(*s, generator=g)
    q, k, v = d(B, NH, S, DK), d(B, NH, S, DK), d(B, NH, S, DV)
    i = torch.rand(B, NH, S, generator=g) * 8 - 4; f = torch.rand(B, NH, S, generator=g) * 10 - 4
    C = d(B, NH, DK, DV) * 0.3; n = d(B, NH, DK) * 0.3; m = d(B, NH)
    return q, k, v, i, f, (C, n, m)

def warp_scan_float32(lf: torch.Tensor) -> torch.Tensor:
    """Inclusive cumulative sums over the last dimension (64) as the kernels' warp scan adds them in float32:
    pairs, then a Hillis-Steele scan over 32 lanes."""
    pair = lf[..., 0::2] + lf[..., 1::2]
    incl, step = pair.clone(), 1
    while step < 32:
        shifted = torch.zeros_like(incl)
        shifted[..., step:] = incl[..., :-step]
        incl = torch.where(torch.arange(32) >= step, incl + shifted, incl)
        step <<= 1
    before = torch.zeros_like(incl)
    before[..., 1:] = incl[..., :-1]
    g = torch.empty_like(lf)
    g[..., 0::2], g[..., 1::2] = before + lf[..., 0::2], incl
    return g


def backward_errors(draws: int, float_scan: bool) -> None:
    import math

    import torch.nn.functional as F

    from bem.kernels.mlstm import custom_ops

    modules = [sys.modules["bem.kernels.mlstm.reference"], sys.modules["bem.kernels.mlstm.backward"]]

    def kernel_gates(igate, fgate, chunk_size, acc):
        S = igate.shape[-1]
        NC = -(-S // chunk_size)
        pad = NC * chunk_size - S
        lf64 = F.pad(F.logsigmoid(fgate.double()), (0, pad), value=0.0).reshape(*igate.shape[:-1], NC, chunk_size)
        i = F.pad(igate.to(acc), (0, pad), value=-math.inf).reshape(*igate.shape[:-1], NC, chunk_size)
        if acc == torch.float32 and float_scan:
            return i, warp_scan_float32(lf64.float())
        return i, lf64.cumsum(-1).to(acc)  # in double, rounded once (float64: exact anyway)

    for module in modules:
        module.chunk_gates = kernel_gates

    def losses(fn, inputs, seed):
        h, last = fn(*inputs)
        g = torch.Generator().manual_seed(seed + 2)
        dh, dC, dn = (torch.randn(t.shape, generator=g) for t in (h, last[0], last[1]))
        dm = ((last[0].double() * dC.double()).sum((-1, -2)) + (last[1].double() * dn.double()).sum(-1)).detach()
        loss = ((h.double() * dh.double()).sum() + (last[0].double() * dC.double()).sum()
                + (last[1].double() * dn.double()).sum() + (last[2].double() * dm).sum())
        return torch.autograd.grad(loss, inputs)

    def kernels_maths(q, k, v, i, f, C, n, m):  # on CPU the op runs the transcription, forward and backward
        h, C_last, n_last, m_last, *_ = custom_ops.mlstm_chunkwise_fwd(q, k, v, i, f, C, n, m)
        return h, (C_last, n_last, m_last)

    names = ["dq", "dk", "dv", "digate", "dfgate", "dC0", "dn0", "dm0"]
    for seed in range(draws):
        q, k, v, i, f, (C, n, m) = draw(2, 2, 70, 100, 64, seed)
        inputs = [t.requires_grad_() for t in (q, k, v, i, f, C, n, m)]
        inputs64 = [t.detach().double().requires_grad_() for t in inputs]
        want = losses(lambda *a: reference.mlstm_chunkwise(*a[:5], tuple(a[5:]), True), inputs64, seed)
        yard = losses(lambda *a: reference.mlstm_parallel(*a[:5], tuple(a[5:]), True), inputs, seed)
        got = losses(kernels_maths, inputs, seed)
        ratios = [rel_err(a, b) / max(rel_err(c, b), 2.0**-24) for a, b, c in zip(got, want, yard)]
        print(f"draw {seed}, error over PyTorch's: " + " ".join(f"{n} {r:.2f}" for n, r in zip(names, ratios)))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4)
    parser.add_argument("--float-scan", action="store_true", help="the gates' scan in float32")
    parser.add_argument("--float-log-weights", action="store_true",
                        help="g, a, pm and the log weights in float32 (the kernels before 2026-11-26, third session)")
    parser.add_argument("--exact-division", action="store_true", help="h = num / n rounded once")
    parser.add_argument("--inputs", help="torch.save'd [q, k, v, igate, fgate, C0, n0, m0] to use instead of draws")
    parser.add_argument("--backward", action="store_true", help="the backward's transcription, see above")
    args = parser.parse_args()
    if args.backward:
        backward_errors(args.draws, args.float_scan)
        return
    EXACT.update(name for name, on in (("float-scan", args.float_scan), ("float-log-weights", args.float_log_weights),
                                       ("division", args.exact_division)) if on)
    if args.inputs:
        loaded = [t.detach().float() for t in torch.load(args.inputs)]
        cases = [("inputs", *loaded[:5], tuple(loaded[5:8]))]
    else:
        cases = ((f"draw {seed}", *draw(2, 3, 100, 64, 64, seed)) for seed in range(args.draws))
    for name, q, k, v, i, f, st in cases:
        B, NH, S, DK = q.shape
        DV = v.shape[-1]
        st64 = tuple(t.double() for t in st)
        h64, _ = reference.mlstm_chunkwise(q.double(), k.double(), v.double(), i.double(), f.double(), st64, True)
        hp, _ = reference.mlstm_parallel(q, k, v, i, f, st, True)
        he = torch.zeros(B, NH, S, DV)
        for b in range(B):
            for hh in range(NH):
                he[b, hh] = torch.from_numpy(forward_row(
                    q[b, hh].numpy(), k[b, hh].numpy(), v[b, hh].numpy(), i[b, hh].numpy(), f[b, hh].numpy(),
                    st[0][b, hh].numpy(), st[1][b, hh].numpy(), float(st[2][b, hh]), DK ** -0.5))
        print(f"{name}: PyTorch parallel {rel_err(hp, h64):.2e}, emulated kernels {rel_err(he, h64):.2e}")

if __name__ == "__main__":
    main()
