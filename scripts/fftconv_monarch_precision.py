"""Emulated accuracy of an FFT long convolution whose DFT passes are tensor-core matrix products (a Monarch
decomposition, N = N1 x N2 [x N3]), by the precision of the products' operands, against PyTorch's rfft path
in the same input dtype: which operand precision meets the fftconv op's bound (at most twice PyTorch's error
against a float64 reference) for each input dtype. Operands are rounded to the precision, products accumulate
in float32, twiddles are applied in float32 (CUDA cores); "x3" splits each float32 operand into a high and a
low part of that precision and sums three products (hi hi + hi lo + lo hi). No GPU needed.

    python scripts/fftconv_monarch_precision.py --L 8192 --factors 16,32,32 --dtype bfloat16
"""

from __future__ import annotations

import argparse
import math

import numpy as np
import torch


def round_mantissa(x: np.ndarray, bits: int) -> np.ndarray:
    """float32 values rounded to `bits` explicit mantissa bits (round to nearest even)."""
    a = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    drop = 23 - bits
    bias = ((a >> drop) & 1) + (1 << (drop - 1)) - 1
    return ((a + bias) >> drop << drop).view(np.float32)


PRECISIONS = {"bf16": lambda x: round_mantissa(x, 7), "fp16": lambda x: np.float32(np.float16(x)),
              "tf32": lambda x: round_mantissa(x, 10), "fp32": lambda x: np.float32(x),
              # x3: a float32 operand as the sum of two in that precision, three products (hi hi + hi lo + lo hi)
              "bf16x3": None, "tf32x3": None}


def cmatmul(a, b, prec):
    """(a @ b) for complex a, b with operands rounded to `prec`, float32 accumulation."""
    if prec in ("bf16x3", "tf32x3"):
        r = PRECISIONS[prec[:4]]
        def split(z):
            hi = r(z.real) + 1j * r(z.imag)
            lo = r(np.float32(z.real - hi.real)) + 1j * r(np.float32(z.imag - hi.imag))
            return hi, lo
        ah, al = split(a); bh, bl = split(b)
        return cmatmul(ah, bh, "fp32") + cmatmul(ah, bl, "fp32") + cmatmul(al, bh, "fp32")
    r = PRECISIONS[prec]
    ar, ai = r(a.real.astype(np.float32)), r(a.imag.astype(np.float32))
    br, bi = r(b.real.astype(np.float32)), r(b.imag.astype(np.float32))
    re = (ar @ br).astype(np.float32) - (ai @ bi).astype(np.float32)
    im = (ar @ bi).astype(np.float32) + (ai @ br).astype(np.float32)
    return (re + 1j * im).astype(np.complex64)


def dft(n, sign):
    k = np.arange(n)
    return np.exp(sign * 2j * np.pi * np.outer(k, k) / n)


def monarch_fft(x, factors, prec, sign=-1):
    """Rows of x (R, N) transformed with N = prod(factors), one matrix product per factor, twiddles in float32."""
    R, N = x.shape
    if len(factors) == 1:
        return cmatmul(x, dft(N, sign).T, prec)
    N1, N2 = factors[0], N // factors[0]
    A = x.reshape(R, N1, N2)                                        # A[r, n1, n2] = x[N2 n1 + n2]
    B = cmatmul(dft(N1, sign), A.transpose(1, 0, 2).reshape(N1, R * N2), prec)   # over n1
    B = B.reshape(N1, R, N2).transpose(1, 0, 2)                     # B[r, k1, n2]
    tw = np.exp(sign * 2j * np.pi * np.outer(np.arange(N1), np.arange(N2)) / N).astype(np.complex64)
    C = (B * tw).astype(np.complex64)                               # float32 twiddles on CUDA cores
    X = monarch_fft(C.reshape(R * N1, N2), factors[1:], prec, sign).reshape(R, N1, N2)   # over n2 -> k2
    return X.transpose(0, 2, 1).reshape(R, N)                       # X[k1 + N1 k2]


def to_dtype(x, name):
    return torch.from_numpy(np.asarray(x, dtype=np.float32)).to(getattr(torch, name))


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--L", type=int, default=8192)
    p.add_argument("--rows", type=int, default=8)
    p.add_argument("--factors", default="128,128")
    p.add_argument("--dtype", default="bfloat16")
    args = p.parse_args()
    L, N = args.L, 2 * args.L
    factors = [int(f) for f in args.factors.split(",")]
    assert math.prod(factors) == N, (factors, N)
    g = np.random.default_rng(0)
    u = to_dtype(g.standard_normal((args.rows, L)), args.dtype)
    decay = np.exp(-np.arange(L) / (L / 8))
    k = to_dtype(g.standard_normal((args.rows, L)) * decay / math.sqrt(L / 8), args.dtype)
    D = to_dtype(g.standard_normal((args.rows, 1)), args.dtype)
    u64, k64, D64 = u.double().numpy(), k.double().numpy(), D.double().numpy()
    # float64 reference (FFT in double is exact to ~1e-15 here)
    ref = np.fft.irfft(np.fft.rfft(u64, N) * np.fft.rfft(k64, N), N)[:, :L] + D64 * u64
    def err(y):
        y = np.asarray(y, dtype=np.float64)
        return np.linalg.norm(y - ref) / np.linalg.norm(ref)
    # PyTorch's path in the same dtype: float32 rfft, product, irfft, D u, cast to the dtype
    uf, kf = u.float(), k.float()
    y_torch = (torch.fft.irfft(torch.fft.rfft(uf, n=N) * torch.fft.rfft(kf, n=N), n=N)[..., :L] + D.float() * uf).to(u.dtype)
    e_torch = err(y_torch.double().numpy())
    e_round = err(to_dtype(ref, args.dtype).double().numpy())
    print(f"L {L}, N {N} = {' x '.join(map(str, factors))}, {args.dtype} in/out, {args.rows} rows")
    print(f"  the float64 answer rounded to {args.dtype}: {e_round:.3e}")
    print(f"  PyTorch rfft path:                 {e_torch:.3e}  (1.00x)")
    K = np.fft.fft(np.pad(k64, ((0, 0), (0, N - L))), axis=1).astype(np.complex64)  # filter spectrum, float32
    for prec in ("bf16", "fp16", "tf32", "bf16x3", "tf32x3", "fp32"):
        x = np.pad(u.float().numpy(), ((0, 0), (0, N - L))).astype(np.complex64)
        U = monarch_fft(x, factors, prec, -1)
        y = monarch_fft((U * K).astype(np.complex64), factors, prec, +1).real[:, :L] / N
        y = (torch.from_numpy(np.float32(y)) + D.float() * uf).to(u.dtype)
        e = err(y.double().numpy())
        print(f"  Monarch, {prec:6s} operands:        {e:.3e}  ({e / e_torch:.2f}x)")


if __name__ == "__main__":
    main()
