"""A lane-level numpy model of the tensor-core fftconv forward (bem/kernels/csrc/fftconv/fftconv_tc.cu), checked against a float64
direct convolution: the same stages, positions, fragment layouts (ldmatrix / stmatrix / mma.m16n8k16 as the PTX
manual gives them), twiddle tables, spectrum order and roundings to float16. Its purpose is the kernel's index
algebra, before any device time; it also prints the error against PyTorch's rfft path in the same dtype. (The
kernel adds D v through the transforms, as a tap at lag 0 of the filter: pass k with D added to k[0].)

    python scripts/fftconv_tc_model.py --L 3000 --dtype bfloat16
"""

from __future__ import annotations

import argparse

import numpy as np
import torch

LANES = 32


def plan(N: int) -> tuple[int, int]:
    """(r, a): N = r 16^a, r in {1, 2, 4, 8}, a in {2, 3}."""
    for a in (3, 2):
        r = N // 16**a
        if r in (1, 2, 4, 8) and r * 16**a == N:
            return r, a
    raise ValueError(N)


def frequency_of(pos: int, N: int) -> int:
    """The frequency the forward stages leave at position pos (digit-reversed, radix r then 16s)."""
    r, a = plan(N)
    s0 = N // r
    q0, rest = divmod(pos, s0)
    f, weight = q0, r
    for m in range(a):  # rest = q1 16^(a-1) + ... + qa: q1 the least significant digit of the frequency
        f += weight * ((rest // 16 ** (a - 1 - m)) % 16)
        weight *= 16
    return f


def w(n: int, e) -> np.ndarray:
    return np.exp(-2j * np.pi * (np.asarray(e) % n) / n)


# ---- fragments: for each lane, the (row, col) of each 16-bit element of an A (16x16), B (16x8), C (16x8) ----

def a_coords(lane: int) -> list[tuple[int, int]]:
    g, c = lane >> 2, (lane & 3) * 2
    return [(g, c), (g, c + 1), (g + 8, c), (g + 8, c + 1), (g, c + 8), (g, c + 9), (g + 8, c + 8), (g + 8, c + 9)]


def b_coords(lane: int) -> list[tuple[int, int]]:  # (k, n)
    n, k = lane >> 2, (lane & 3) * 2
    return [(k, n), (k + 1, n), (k + 8, n), (k + 9, n)]


def c_coords(lane: int) -> list[tuple[int, int]]:
    g, c = lane >> 2, (lane & 3) * 2
    return [(g, c), (g, c + 1), (g + 8, c), (g + 8, c + 1)]


def mma(a_frag, b_frag):
    """a_frag[lane][8], b_frag[lane][4] -> c_frag[lane][4] (float32 accumulation of float16 operands)."""
    A = np.zeros((16, 16), np.float32)
    B = np.zeros((16, 8), np.float32)
    for lane in range(LANES):
        for v, (i, j) in zip(a_frag[lane], a_coords(lane)):
            A[i, j] = v
        for v, (i, j) in zip(b_frag[lane], b_coords(lane)):
            B[i, j] = v
    C = A.astype(np.float64) @ B.astype(np.float64)
    return [[np.float32(C[i, j]) for (i, j) in c_coords(lane)] for lane in range(LANES)]


def ldmatrix_x4(plane, addrs, trans):
    """addrs[lane]: the start of row (lane & 7) of matrix (lane >> 3); 8 halves a row. Returns regs[lane][4][2]."""
    regs = [[None] * 4 for _ in range(LANES)]
    for m in range(4):
        rows = [plane[addrs[8 * m + i]: addrs[8 * m + i] + 8] for i in range(8)]
        for lane in range(LANES):
            rr, cc = lane >> 2, (lane & 3) * 2
            if trans:
                regs[lane][m] = (rows[cc][rr], rows[cc + 1][rr])
            else:
                regs[lane][m] = (rows[rr][cc], rows[rr][cc + 1])
    return regs


def stmatrix_x4(plane, addrs, regs, trans):
    for m in range(4):
        M = np.zeros((8, 8), np.float16)
        for lane in range(LANES):
            rr, cc = lane >> 2, (lane & 3) * 2
            M[rr, cc], M[rr, cc + 1] = regs[lane][m]
        if trans:
            M = M.T
        for i in range(8):
            plane[addrs[8 * m + i]: addrs[8 * m + i] + 8] = M[i]


def a_from_ld(regs):
    """ldmatrix.x4 registers as an A fragment (reg m = matrix m, in a_coords order)."""
    return [[h for m in range(4) for h in regs[lane][m]] for lane in range(LANES)]


# ---- the DFT-16 as B fragments: B[k][n] = W16^{kn} / 4 (forward) or its conjugate (inverse), n-tiles 0 and 1 ----

def dft_b(inverse: bool):
    F = w(16, np.outer(np.arange(16), np.arange(16))) / 4
    if inverse:
        F = F.conj()
    out = {}
    for name, M in (("re", F.real), ("im", F.imag), ("neg_im", -F.imag)):
        frags = []
        for nt in range(2):
            frags.append([[np.float16(M[k, 8 * nt + n]) for (k, n) in b_coords(lane)] for lane in range(LANES)])
        out[name] = frags
    return out


def complex_mma(ar, ai, b, inverse: bool):
    """(Cr, Ci)[ntile] for X (rows) times the DFT: forward Cr = Ar Br - Ai Bi, Ci = Ar Bi + Ai Br; inverse with
    conj(B) given: the same formulas with b built from the conjugate."""
    out = []
    for nt in range(2):
        cr1 = mma(ar, b["re"][nt])
        cr2 = mma(ai, b["neg_im"][nt])
        ci1 = mma(ar, b["im"][nt])
        ci2 = mma(ai, b["re"][nt])
        cr = [[np.float32(x + y) for x, y in zip(p, q)] for p, q in zip(cr1, cr2)]
        ci = [[np.float32(x + y) for x, y in zip(p, q)] for p, q in zip(ci1, ci2)]
        out.append((cr, ci))
    return out


def c_rowcol(lane: int, nt: int, e: int) -> tuple[int, int]:
    r, c = c_coords(lane)[e]
    return r, c + 8 * nt


def twiddle(out, fn):
    """out[nt] = (cr, ci): multiply each element by fn(lane, row, col) (complex), float32."""
    for nt in range(2):
        cr, ci = out[nt]
        for lane in range(LANES):
            for e in range(4):
                row, col = c_rowcol(lane, nt, e)
                t = np.complex64(fn(lane, row, col))
                z = np.complex64(complex(cr[lane][e], ci[lane][e])) * t
                cr[lane][e], ci[lane][e] = np.float32(z.real), np.float32(z.imag)


def twiddle_half2(out, fn):
    """twiddle() in float16 pairs, as HMUL2 / HFMA2 take it: C rounded to float16 first, then re' = re wr - (im wi),
    im' = re wi + (im wr), each product in parentheses rounded, each fused sum rounded once."""
    f16, f32 = np.float16, np.float32
    for nt in range(2):
        cr, ci = out[nt]
        for lane in range(LANES):
            for e in range(4):
                row, col = c_rowcol(lane, nt, e)
                t = complex(fn(lane, row, col))
                wr, wi = f16(t.real), f16(t.imag)
                ar, ai = f16(cr[lane][e]), f16(ci[lane][e])
                re = f16(f32(ar) * f32(wr) - f32(f16(f32(ai) * f32(wi))))
                im = f16(f32(ar) * f32(wi) + f32(f16(f32(ai) * f32(wr))))
                cr[lane][e], ci[lane][e] = f32(re), f32(im)


def pack_c(out, part):
    """The four stmatrix registers of C (re or im): (nt0 rows g), (nt0 rows g+8), (nt1 rows g), (nt1 rows g+8)."""
    idx = 0 if part == "re" else 1
    regs = []
    for lane in range(LANES):
        c0 = out[0][idx][lane]
        c1 = out[1][idx][lane]
        regs.append([(np.float16(c0[0]), np.float16(c0[1])), (np.float16(c0[2]), np.float16(c0[3])),
                     (np.float16(c1[0]), np.float16(c1[1])), (np.float16(c1[2]), np.float16(c1[3]))])
    return regs


def c_as_a(out, part):
    """C (rows g, cols 0..15 over the two n-tiles) as an A fragment with k = col, rounded to float16."""
    idx = 0 if part == "re" else 1
    frag = []
    for lane in range(LANES):
        c0, c1 = out[0][idx][lane], out[1][idx][lane]
        frag.append([np.float16(x) for x in (c0[0], c0[1], c0[2], c0[3], c1[0], c1[1], c1[2], c1[3])])
    return frag


def movmatrix_trans(regs_one):
    """movmatrix.trans of one 8 x 8 matrix in fragment layout (regs_one[lane] = its two halves)."""
    M = np.zeros((8, 8), np.float16)
    for lane in range(LANES):
        r, c = lane >> 2, (lane & 3) * 2
        M[r, c], M[r, c + 1] = regs_one[lane]
    T = M.T
    return [(T[lane >> 2, (lane & 3) * 2], T[lane >> 2, (lane & 3) * 2 + 1]) for lane in range(LANES)]


def transposed_a(out, part):
    """The A fragment of C's transpose: C packed (pack_c), each 8 x 8 block through movmatrix, the two off the
    diagonal trading places."""
    packed = pack_c(out, part)
    t = [movmatrix_trans([packed[lane][i] for lane in range(LANES)]) for i in range(4)]
    return [[h for i in (0, 2, 1, 3) for h in t[i][lane]] for lane in range(LANES)]


def strided_addrs(n: int, b: int, j1: int, s: int):
    """ldmatrix.trans / stmatrix.trans rows: lane -> matrix m, row i: t = i + 8 (m >> 1), j = 16 j1 + 8 (m & 1)."""
    addrs = []
    for lane in range(LANES):
        m, i = lane >> 3, lane & 7
        addrs.append(b * n + 16 * j1 + 8 * (m & 1) + (i + 8 * (m >> 1)) * s)
    return addrs


def scale_of(x: np.ndarray) -> float:
    """The power of two that brings max |x| into (0.5, 1] (1 for zeros)."""
    m = float(np.max(np.abs(x))) if x.size else 0.0
    return 1.0 if m == 0 else 2.0 ** -np.ceil(np.log2(m))


def transform(z: np.ndarray, N: int, half2: bool, product=None, capture=None):
    """The kernel's passes on one complex signal z (N points): the forward passes, then in the block pass either
    capture[tau] = the spectrum's tile as float16 (the filter-gradient kernel's first transform, which stops there)
    or product(tau, out, pairs) on it, then the inverse passes. Returns the N outputs (complex), or None."""
    r, a = plan(N)
    s0 = N // r
    re = np.zeros(N, np.float16)
    im = np.zeros(N, np.float16)
    # SIMT forward stage: y_q = r^-1/2 sum_t x_t W_r^{tq} W_N^{jq} at j + q s0
    for j in range(s0):
        xs = [z[j + t * s0] for t in range(r)]
        for q in range(r):
            y = sum(xs[t] * w(r, t * q) for t in range(r)) * w(N, j * q) / np.sqrt(r)
            re[j + q * s0], im[j + q * s0] = np.float16(y.real), np.float16(y.imag)
    fwd, inv = dft_b(False), dft_b(True)
    tiles = N // 256

    def outer_pass(inverse: bool) -> None:  # blocks of 4096, stride 256 (a = 3)
        for tau in range(tiles):
            b, j1 = divmod(tau, 16)
            addrs = strided_addrs(4096, b, j1, 256)
            ar, ai = a_from_ld(ldmatrix_x4(re, addrs, True)), a_from_ld(ldmatrix_x4(im, addrs, True))
            out = complex_mma(ar, ai, inv if inverse else fwd, inverse)
            if not inverse:
                twiddle(out, lambda lane, row, col: w(4096, (16 * j1 + row) * col))
            stmatrix_x4(re, addrs, pack_c(out, "re"), True)
            stmatrix_x4(im, addrs, pack_c(out, "im"), True)

    if a == 3:
        outer_pass(False)
    # the block pass: one 256-point block a tile in registers, from the stride-16 forward pass to the stride-16
    # inverse pass; float16-pair twiddles (twiddle_pairs) for W_256 and the spectrum, as the kernel takes them
    pairs = twiddle_half2 if half2 else twiddle
    for tau in range(tiles):
        addrs = strided_addrs(256, tau, 0, 16)
        ar, ai = a_from_ld(ldmatrix_x4(re, addrs, True)), a_from_ld(ldmatrix_x4(im, addrs, True))
        out = complex_mma(ar, ai, fwd, False)
        pairs(out, lambda lane, row, col: w(256, row * col))
        out = complex_mma(transposed_a(out, "re"), transposed_a(out, "im"), fwd, False)
        if capture is not None:
            capture[tau] = {c_rowcol(lane, nt, e): complex(np.float16(out[nt][0][lane][e]), np.float16(out[nt][1][lane][e]))
                            for nt in range(2) for lane in range(LANES) for e in range(4)}
            continue
        product(tau, out, pairs)
        out = complex_mma(c_as_a(out, "re"), c_as_a(out, "im"), inv, True)
        pairs(out, lambda lane, row, col: w(256, -row * col))
        out = complex_mma(transposed_a(out, "re"), transposed_a(out, "im"), inv, True)
        if a == 3:  # the outer inverse pass's input twiddle at position 256 tau + row + 16 col
            twiddle(out, lambda lane, row, col: w(4096, -(row + 16 * col) * (tau % 16)))
        stmatrix_x4(re, addrs, pack_c(out, "re"), True)
        stmatrix_x4(im, addrs, pack_c(out, "im"), True)
    if capture is not None:
        return None
    if a == 3:
        outer_pass(True)
    # SIMT inverse stage
    y = np.zeros(N, np.complex128)
    for j in range(s0):
        xs = [complex(np.float32(re[j + q * s0]), np.float32(im[j + q * s0])) * w(N, -j * q) for q in range(r)]
        for t in range(r):
            y[j + t * s0] = sum(xs[q] * w(r, -t * q) for q in range(r)) / np.sqrt(r)
    return y


def fftconv_tc(v1: np.ndarray, v2: np.ndarray, k: np.ndarray, N: int,
               half2: bool = True, correlate: bool = False) -> tuple[np.ndarray, np.ndarray]:
    """Causal conv (or with `correlate`, the correlation) of two real rows (length L <= N / 2) with one filter, as
    the kernel computes it."""
    L = len(v1)
    s1, s2 = scale_of(v1), scale_of(v2)
    z = np.zeros(N, np.complex64)
    z[:L] = (np.float32(v1) * np.float32(s1)) + 1j * (np.float32(v2) * np.float32(s2))
    # filter spectrum, its scale and the fragment-order table the block pass reads
    kp = np.zeros(N)
    kp[: len(k)] = k
    S = np.fft.rfft(kp)  # (N/2 + 1)
    full = np.concatenate([S, np.conj(S[1:-1][::-1])])
    if correlate:
        full = np.conj(full)
    sk = 2.0 ** -np.ceil(np.log2(max(np.abs(S.real).max(), np.abs(S.imag).max())))
    K16 = (full * sk).astype(np.complex64)
    order = np.array([frequency_of(p, N) for p in range(N)])
    Kr, Ki = np.float16(K16.real[order]), np.float16(K16.imag[order])

    def product(tau, out, pairs):
        pairs(out, lambda lane, row, col: complex(Kr[16 * (16 * tau + row) + col], Ki[16 * (16 * tau + row) + col]))

    y = transform(z, N, half2, product=product)[:L]
    return (y.real / (s1 * sk)).astype(np.float32), (y.imag / (s2 * sk)).astype(np.float32)


def filter_grad_tc(g: np.ndarray, v: np.ndarray, N: int, taps: int, half2: bool = True) -> np.ndarray:
    """dk[j] = sum_b sum_t g_b[t] v_b[t - j] over two rows (g, v: (2, L)), as the filter-gradient kernel computes
    it: Re IFFT(Zg conj(Zv)) holds corr(g1, v1) + corr(g2, v2) (the cross terms come back imaginary), so each of z
    takes one scale for both its rows; Zg is kept as float16 pairs from a first transform."""
    L = g.shape[1]
    sg, sv = scale_of(g), scale_of(v)
    zg = np.zeros(N, np.complex64)
    zv = np.zeros(N, np.complex64)
    zg[:L] = np.float32(g[0] * sg) + 1j * np.float32(g[1] * sg)
    zv[:L] = np.float32(v[0] * sv) + 1j * np.float32(v[1] * sv)
    kept = {}
    transform(zg, N, half2, capture=kept)

    def product(tau, out, pairs):
        for nt in range(2):
            out[nt][1][:] = [[-x for x in row] for row in out[nt][1]]  # conj(Zv)
        pairs(out, lambda lane, row, col: kept[tau][(row, col)])

    y = transform(zv, N, half2, product=product)
    # unitary passes: Fu^H (Fu g conj(Fu v)) = IFFT(G conj V) / sqrt(N)
    return (y.real[:taps] * np.sqrt(N) / (sg * sv)).astype(np.float32)


def direct(v: np.ndarray, k: np.ndarray) -> np.ndarray:
    L = len(v)
    kk = np.zeros(L)
    kk[: min(L, len(k))] = k[:L]
    return np.convolve(v.astype(np.float64), kk)[:L]


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--L", type=int, default=3000)
    p.add_argument("--Lk", type=int, default=None)
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--float32-twiddles", action="store_true",
                   help="the block pass's twiddles in float32 (the kernel takes float16 pairs)")
    args = p.parse_args()
    dt = getattr(torch, args.dtype)
    g = torch.Generator().manual_seed(args.seed)
    L, Lk = args.L, args.Lk or args.L
    M = max(1024, 1 << (L - 1).bit_length())
    N = 2 * M
    v = torch.randn(2, L, generator=g).to(dt).double().numpy()
    k = (torch.randn(Lk, generator=g) * Lk**-0.5).double().numpy()
    y1, y2 = fftconv_tc(v[0], v[1], k, N, half2=not args.float32_twiddles)
    ref = np.stack([direct(v[0], k), direct(v[1], k)])
    mine = torch.tensor(np.stack([y1, y2])).to(dt).double().numpy()
    vt = torch.tensor(v).to(dt).float()
    kt = torch.zeros(N)
    kt[:min(Lk, L)] = torch.tensor(k[:L]).float()
    theirs = torch.fft.irfft(torch.fft.rfft(vt, n=N) * torch.fft.rfft(kt, n=N), n=N)[:, :L].to(dt).double().numpy()
    err = np.linalg.norm(mine - ref) / np.linalg.norm(ref)
    terr = np.linalg.norm(theirs - ref) / np.linalg.norm(ref)
    print(f"L {L} N {N} plan {plan(N)}: error {err:.3e}, PyTorch {terr:.3e}, ratio {err / terr:.2f}")


if __name__ == "__main__":
    main()
