// The block FFT of the fftconv kernels: one thread block transforms one real row of length 2M (M = 1024 ..
// 16384) in shared memory, as a complex FFT of size M of z[n] = x[2n] + i x[2n+1] followed by the usual
// split into the real signal's bins. The convolution of a row is
//
//   load + first pass | radix-16 passes | last pass + bin pairing + the bin-wise op (in registers, the
//   filter's spectrum staged into shared memory meanwhile) | inverse: first pass | radix-16 passes
//   | last pass + epilogue (to global or shared memory)
//
// Passes are Stockham radix-R (natural order in, natural order out, no bit reversal): pass p with current
// sub-transform size Ns reads x[j + r M/R], multiplies by exp(-2 pi i r k / (Ns R)) (k = j mod Ns), does a
// radix-R DFT in registers and writes y[(j - k) R + k + r Ns]. M = R0 * 16^a: one pass of radix R0 (2, 4,
// 8 or 16, no twiddles), then a radix-16 passes. Each of the M / 32 threads holds 32 values.
//
// - The input of a forward transform is zero past n = M/2 (L <= M): the first pass skips those loads and
//   the butterflies their arithmetic; the inverse's outputs past n = M/2 are never used and not computed.
// - Bin pairing: X[k] and X[M-k] need Z[k] and Z[M-k]; in the last forward pass thread t holds the
//   butterflies t and Ns - t (thread 0: 0 and Ns/2), so each thread holds both bins of every pair and
//   untangles, applies the op and re-tangles for the inverse without another pass through shared memory
//   (each pair's result written back at once to the slots only this thread uses).
// - The inverse is the forward transform of the conjugate; the spectrum is left unscaled (S = rfft(k)),
//   the epilogues apply 1/(4M) (a power of two: exact). D ⊙ v is added in the epilogues, exactly: folded
//   into the spectrum it took the FFT's rounding and doubled the float32 error against PyTorch's.
// - Twiddles: a table per block in shared memory of w, w^2, w^3, w^4, w^8, w^12 per (pass, k), built with
//   double precision sincospi; every other power is one product of two of them (deriving all powers from
//   w alone measured 2.8x the error of exact twiddles at M = 16384 in float32).
// - Shared memory rows are padded by one float2 every 16 (pad()): the strided writes of the first passes
//   and the reads of every pass are then free of bank conflicts.
//
// The ops, epilogues and kernel bodies around the transform are in fftconv_rows.cuh. Kept free of torch
// headers; compiled by nvcc for the GPU and, for a host-side emulation of a block's threads
// (BEM_FFT_EMULATED), by a C++ compiler.
#pragma once

#if defined(__CUDACC__)
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#define BEM_FFT_FN __device__ __forceinline__
#define BEM_FFT_HD __host__ __device__
#define BEM_FFT_SHARED(name) extern __shared__ float4 name[]
#else
// The emulation harness defines float2, float4, make_float2/4, threadIdx, blockIdx, gridDim,
// __syncthreads, sincospi, erff, expf and the hooks below before including this file.
#define BEM_FFT_FN inline
#define BEM_FFT_HD
#define BEM_FFT_SHARED(name) float4* name = bem_fft_emulated_smem()
#endif

#include <cstdint>

#include "../common/l2_prefetch.cuh"

namespace bem {
namespace fftconv {

// Register pressure: every index of a pass is the same for every row, and the compiler hoisted them (and
// the pairing's twiddles) out of the row loop into registers: 220-255 registers where the launch bounds
// allow 128, and spills. thread_index() hides that the thread index is the same in every pass (a volatile
// read of %tid.x), so indices are recomputed per pass, cheaply; the pairing's base twiddle is read from
// shared memory per row. BEM_FFT_ORDER() keeps the compiler from moving memory accesses across it (no
// instruction): the two butterflies of a thread are loaded and transformed one after the other.
#if defined(__CUDACC__)
#define BEM_FFT_ORDER() asm volatile("" ::: "memory")
__device__ __forceinline__ int thread_index() {
  int t;
  asm volatile("mov.u32 %0, %%tid.x;" : "=r"(t));
  return t;
}
#else
#define BEM_FFT_ORDER()
inline int thread_index() { return (int)threadIdx.x; }
#endif

// 8-byte global -> shared copy that takes no register (sm_80+), and the wait for this thread's copies.
#if defined(__CUDACC__)
__device__ __forceinline__ void copy_async8(float2* smem, const float2* global) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.ca.shared.global [%0], [%1], 8;\n" ::"r"(dst), "l"(global));
}
__device__ __forceinline__ void wait_async_copies() { asm volatile("cp.async.wait_all;\n" ::: "memory"); }
#else
inline void copy_async8(float2* smem, const float2* global) {
  bem_fft_emulated_access(smem, true);
  *smem = *global;
}
inline void wait_async_copies() {}
#endif

// The lines of row[0 .. n) into L2 (prefetch_l2), spread over the block's threads: inputs read later in a row,
// and the next row's.
template <typename T>
BEM_FFT_FN void prefetch_row_l2(const T* row, int64_t n, int t, int threads) {
  if (row == nullptr) return;
  constexpr int64_t kLine = 128 / sizeof(T);
  for (int64_t i = (int64_t)t * kLine; i < n; i += (int64_t)threads * kLine) prefetch_l2(row + i);
}

// ---------------------------------------------------------------------------------------------------
// complex arithmetic on float2

BEM_FFT_FN float2 cadd(float2 a, float2 b) { return make_float2(a.x + b.x, a.y + b.y); }
BEM_FFT_FN float2 csub(float2 a, float2 b) { return make_float2(a.x - b.x, a.y - b.y); }
BEM_FFT_FN float2 cmul(float2 a, float2 b) { return make_float2(a.x * b.x - a.y * b.y, a.x * b.y + a.y * b.x); }
// a * conj(b)
BEM_FFT_FN float2 cmulc(float2 a, float2 b) { return make_float2(a.x * b.x + a.y * b.y, a.y * b.x - a.x * b.y); }
BEM_FFT_FN float2 conj2(float2 a) { return make_float2(a.x, -a.y); }
BEM_FFT_FN float2 mul_i(float2 a) { return make_float2(-a.y, a.x); }
BEM_FFT_FN float2 mul_neg_i(float2 a) { return make_float2(a.y, -a.x); }
BEM_FFT_FN float2 cscale(float2 a, float s) { return make_float2(a.x * s, a.y * s); }

// exp(-2 pi i m / 16) for the radix-16 butterfly's inner twiddles
#define BEM_W16_1 make_float2(0.92387953251128674f, -0.38268343236508978f)
#define BEM_W16_2 make_float2(0.70710678118654752f, -0.70710678118654752f)
#define BEM_W16_3 make_float2(0.38268343236508978f, -0.92387953251128674f)
#define BEM_W16_6 make_float2(-0.70710678118654752f, -0.70710678118654752f)
#define BEM_W16_9 make_float2(-0.92387953251128674f, 0.38268343236508978f)
#define BEM_W8_1 make_float2(0.70710678118654752f, -0.70710678118654752f)
#define BEM_W8_3 make_float2(-0.70710678118654752f, -0.70710678118654752f)

// base * exp(-i pi r / 16), r in 0..15 (a compile-time constant after unrolling)
BEM_FFT_FN float2 rotate32(float2 base, int r) {
  constexpr float c[8] = {1.0f, 0.98078528040323043f, 0.92387953251128674f, 0.83146961230254524f,
                          0.70710678118654752f, 0.55557023301960218f, 0.38268343236508978f,
                          0.19509032201612825f};
  if (r == 0) return base;
  if (r == 8) return mul_neg_i(base);
  // exp(-i pi r/16) = (cos, -sin); cos(pi r/16) = c[r] for r < 8, -c[16-r] for r > 8; sin(pi r/16) = c[8-r]
  // for r <= 8 and c[r-8] for r >= 8
  const float cr = r < 8 ? c[r] : -c[16 - r];
  const float sr = r < 8 ? c[8 - r] : c[r - 8];
  return cmul(base, make_float2(cr, -sr));
}

// ---------------------------------------------------------------------------------------------------
// small DFTs in registers, natural order in and out; kHalfIn: the upper half of the inputs is zero (and
// not read); kHalfOut: only the lower half of the outputs is computed

template <bool kHalfIn>
BEM_FFT_FN void dft2(float2* v) {
  if (kHalfIn) {
    v[1] = v[0];
  } else {
    const float2 a = v[0], b = v[1];
    v[0] = cadd(a, b);
    v[1] = csub(a, b);
  }
}

template <bool kHalfIn>
BEM_FFT_FN void dft4(float2& a0, float2& a1, float2& a2, float2& a3) {
  if (kHalfIn) {
    const float2 x0 = a0, x1 = a1;
    a0 = cadd(x0, x1);
    a2 = csub(x0, x1);
    a1 = cadd(x0, mul_neg_i(x1));
    a3 = cadd(x0, mul_i(x1));
  } else {
    const float2 s02 = cadd(a0, a2), d02 = csub(a0, a2), s13 = cadd(a1, a3), d13 = csub(a1, a3);
    a0 = cadd(s02, s13);
    a2 = csub(s02, s13);
    a1 = cadd(d02, mul_neg_i(d13));
    a3 = cadd(d02, mul_i(d13));
  }
}

// outputs 0 and 1 only
BEM_FFT_FN void dft4_low(float2& a0, float2& a1, float2 a2, float2 a3) {
  const float2 s02 = cadd(a0, a2), d02 = csub(a0, a2), s13 = cadd(a1, a3), d13 = csub(a1, a3);
  a0 = cadd(s02, s13);
  a1 = cadd(d02, mul_neg_i(d13));
}

template <bool kHalfIn>
BEM_FFT_FN void dft8(float2* v) {
  // n = 2 n1 + n2, k = k1 + 4 k2
  dft4<kHalfIn>(v[0], v[2], v[4], v[6]);  // n2 = 0: A[0][k1] in v[2 k1]
  dft4<kHalfIn>(v[1], v[3], v[5], v[7]);  // n2 = 1: A[1][k1] in v[2 k1 + 1]
  v[3] = cmul(v[3], BEM_W8_1);
  v[5] = mul_neg_i(v[5]);
  v[7] = cmul(v[7], BEM_W8_3);
  float2 out[8];
#pragma unroll
  for (int k1 = 0; k1 < 4; ++k1) {
    out[k1] = cadd(v[2 * k1], v[2 * k1 + 1]);
    out[k1 + 4] = csub(v[2 * k1], v[2 * k1 + 1]);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = out[i];
}

template <bool kHalfIn, bool kHalfOut>
BEM_FFT_FN void dft16(float2* v) {
  // n = 4 n1 + n2, k = k1 + 4 k2: radix-4 over n1, twiddle W16^(n2 k1), radix-4 over n2
#pragma unroll
  for (int n2 = 0; n2 < 4; ++n2) dft4<kHalfIn>(v[n2], v[4 + n2], v[8 + n2], v[12 + n2]);
  // v[n2 + 4 k1] = A[n2][k1]
  v[5] = cmul(v[5], BEM_W16_1);
  v[9] = cmul(v[9], BEM_W16_2);
  v[13] = cmul(v[13], BEM_W16_3);
  v[6] = cmul(v[6], BEM_W16_2);
  v[10] = mul_neg_i(v[10]);
  v[14] = cmul(v[14], BEM_W16_6);
  v[7] = cmul(v[7], BEM_W16_3);
  v[11] = cmul(v[11], BEM_W16_6);
  v[15] = cmul(v[15], BEM_W16_9);
  float2 out[16];
#pragma unroll
  for (int k1 = 0; k1 < 4; ++k1) {
    float2 a0 = v[4 * k1], a1 = v[4 * k1 + 1], a2 = v[4 * k1 + 2], a3 = v[4 * k1 + 3];
    if (kHalfOut) {
      dft4_low(a0, a1, a2, a3);
    } else {
      dft4<false>(a0, a1, a2, a3);
    }
    out[k1] = a0;
    out[k1 + 4] = a1;
    out[k1 + 8] = a2;
    out[k1 + 12] = a3;
  }
#pragma unroll
  for (int i = 0; i < (kHalfOut ? 8 : 16); ++i) v[i] = out[i];
}

template <int R, bool kHalfIn>
BEM_FFT_FN void dft(float2* v) {
  if constexpr (R == 2) {
    dft2<kHalfIn>(v);
  } else if constexpr (R == 4) {
    dft4<kHalfIn>(v[0], v[1], v[2], v[3]);
  } else if constexpr (R == 8) {
    dft8<kHalfIn>(v);
  } else {
    dft16<kHalfIn, false>(v);
  }
}

// v[r] *= w^r, r = 1..15, from the table entry (w, w^2 | w^3, w^4 | w^8, w^12)
BEM_FFT_FN void twiddle16(float2* v, const float4* entry) {
  const float4 t0 = entry[0], t1 = entry[1], t2 = entry[2];
  const float2 w1 = make_float2(t0.x, t0.y), w2 = make_float2(t0.z, t0.w);
  const float2 w3 = make_float2(t1.x, t1.y), w4 = make_float2(t1.z, t1.w);
  const float2 w8 = make_float2(t2.x, t2.y), w12 = make_float2(t2.z, t2.w);
  v[1] = cmul(v[1], w1);
  v[2] = cmul(v[2], w2);
  v[3] = cmul(v[3], w3);
  v[4] = cmul(v[4], w4);
  v[5] = cmul(v[5], cmul(w4, w1));
  v[6] = cmul(v[6], cmul(w4, w2));
  v[7] = cmul(v[7], cmul(w4, w3));
  v[8] = cmul(v[8], w8);
  v[9] = cmul(v[9], cmul(w8, w1));
  v[10] = cmul(v[10], cmul(w8, w2));
  v[11] = cmul(v[11], cmul(w8, w3));
  v[12] = cmul(v[12], w12);
  v[13] = cmul(v[13], cmul(w12, w1));
  v[14] = cmul(v[14], cmul(w12, w2));
  v[15] = cmul(v[15], cmul(w12, w3));
}

// ---------------------------------------------------------------------------------------------------
// the block transform

template <int M>
struct Plan {
  static_assert(M >= 1024 && M <= 16384 && (M & (M - 1)) == 0, "M is a power of two in [1024, 16384]");
  static constexpr int kThreads = M / 32;
  static constexpr int kPasses16 = M >= 8192 ? 3 : 2;     // radix-16 passes after the first pass
  static constexpr int kFirst = M >> (4 * kPasses16);     // the first pass's radix: 4, 8, 16, 2, 4
  static constexpr int kNs = M / 16;                      // Ns of the last pass
  static constexpr int kBuf = M + M / 16 + 2;             // float2s, padded; pad(M) holds a staged bin M
  static constexpr int kTwiddles = (M - kFirst) / 15;     // table entries, three float4 each
  // the data, the twiddle table, each thread's pairing base, a block sum's doubles
  static constexpr int kSmemBytes = kBuf * 8 + kTwiddles * 48 + kThreads * 8 + kThreads * 8;
  // blocks per multiprocessor the launch bounds ask for: 128 registers per thread
  static constexpr int kMinBlocks = 16384 / M;
  static BEM_FFT_HD constexpr int table_offset(int pass) { return kFirst * ((1 << (4 * pass)) - 1) / 15; }
};

template <int M>
struct BlockFft {
  using P = Plan<M>;
  float2* buf;
  float4* tw;
  float2* pair_base;  // exp(-i pi t / M) per thread: the bins t + r M/16 of the pairing
  double* red;
  int t;

  BEM_FFT_FN explicit BlockFft(float4* smem)
      : buf(reinterpret_cast<float2*>(smem)),
        tw(smem + P::kBuf / 2),
        pair_base(reinterpret_cast<float2*>(smem + P::kBuf / 2 + 3 * P::kTwiddles)),
        red(reinterpret_cast<double*>(pair_base + P::kThreads)),
        t((int)threadIdx.x) {}

  // The sum of every thread's x, in thread 0 (all threads call it).
  BEM_FFT_FN double block_sum(double x) const {
    red[t] = x;
    __syncthreads();
    if (t < 32) {
      double s = 0.0;
      for (int i = t; i < P::kThreads; i += 32) s += red[i];
      red[t] = s;
    }
    __syncthreads();
    double total = 0.0;
    if (t == 0)
      for (int i = 0; i < 32; ++i) total += red[i];
    __syncthreads();
    return total;
  }

  static BEM_FFT_FN int pad(int i) { return i + (i >> 4); }
  // pad(j + r * stride) = pad(j) + r * padded_stride(stride) when stride is a multiple of 16: with the
  // offsets compile-time constants, a butterfly's 16 addresses are one register plus immediates.
  static BEM_FFT_HD constexpr int padded_stride(int stride) { return stride + stride / 16; }

  // accesses by padded index
  BEM_FFT_FN float2 ldp(int at) const {
#ifdef BEM_FFT_EMULATED
    bem_fft_emulated_access(buf + at, false);
#endif
    return buf[at];
  }
  BEM_FFT_FN void stp(int at, float2 v) const {
#ifdef BEM_FFT_EMULATED
    bem_fft_emulated_access(buf + at, true);
#endif
    buf[at] = v;
  }
  BEM_FFT_FN float2 ld(int i) const { return ldp(pad(i)); }
  BEM_FFT_FN void st(int i, float2 v) const { stp(pad(i), v); }
  // Volatile accesses keep their program order in ptxas: the pairing's loads of staged bins are otherwise
  // all hoisted to its start (their addresses provably differ from the stores'), 64 registers that spilled.
  BEM_FFT_FN float2 ld_ordered(int padded) const {
#if defined(__CUDACC__)
    float2 v;
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(buf + padded));
    asm volatile("ld.volatile.shared.v2.f32 {%0, %1}, [%2];" : "=f"(v.x), "=f"(v.y) : "r"(at));
    return v;
#else
    return ldp(padded);
#endif
  }
  BEM_FFT_FN void st_ordered(int padded, float2 v) const {
#if defined(__CUDACC__)
    const unsigned at = static_cast<unsigned>(__cvta_generic_to_shared(buf + padded));
    asm volatile("st.volatile.shared.v2.f32 [%0], {%1, %2};" ::"r"(at), "f"(v.x), "f"(v.y) : "memory");
#else
    stp(padded, v);
#endif
  }

  // The twiddle table: entry e of pass p (Ns = kFirst 16^p, k = e - table_offset(p)) holds
  // exp(-2 pi i q k / (16 Ns)) for q = 1, 2 | 3, 4 | 8, 12. Read only after the first pass's barriers.
  BEM_FFT_FN void build_twiddles() const {
    {
      double s, c;
      sincospi(-(double)t / M, &s, &c);
      pair_base[t] = make_float2((float)c, (float)s);
    }
    for (int e = t; e < P::kTwiddles; e += P::kThreads) {
      int offset = 0, Ns = P::kFirst;
      while (e >= offset + Ns) {
        offset += Ns;
        Ns *= 16;
      }
      const int k = e - offset;
      constexpr int kPowers[6] = {1, 2, 3, 4, 8, 12};
      float w[12];
#pragma unroll
      for (int q = 0; q < 6; ++q) {
        double s, c;
        sincospi(-(double)(kPowers[q] * k) / (8.0 * Ns), &s, &c);
        w[2 * q] = (float)c;
        w[2 * q + 1] = (float)s;
      }
#pragma unroll
      for (int q = 0; q < 3; ++q) tw[3 * e + q] = make_float4(w[4 * q], w[4 * q + 1], w[4 * q + 2], w[4 * q + 3]);
    }
  }

  // First pass: radix kFirst, Ns = 1. load(n, pad(n)) gives z[n]; kHalfIn: z[n] = 0 for n >= M/2 (not loaded).
  template <bool kHalfIn, class Load>
  BEM_FFT_FN void first_pass(const Load& load) const {
    constexpr int R = P::kFirst, B = 32 / R, S = M / R;
    const int t = thread_index();
    float2 v[B][R];
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int j = t + q * P::kThreads;
#pragma unroll
      for (int r = 0; r < (kHalfIn ? R / 2 : R); ++r) v[q][r] = load(j + r * S, pad(j) + r * padded_stride(S));
    }
#pragma unroll
    for (int q = 0; q < B; ++q) dft<R, kHalfIn>(v[q]);
    __syncthreads();  // every read of buf (this pass's or the previous transform's) before any write
#pragma unroll
    for (int q = 0; q < B; ++q) {
      const int base = pad((t + q * P::kThreads) * R);  // R divides 16: the R outputs share one pad step
#pragma unroll
      for (int r = 0; r < R; ++r) stp(base + r, v[q][r]);
    }
    __syncthreads();
  }

  // the two butterflies of a radix-16 pass, loaded, twiddled and transformed one after the other
  template <bool kHalfOut>
  BEM_FFT_FN void load16(float2 (&v)[2][16], int pass, int (&k)[2]) const {
    const int Ns = P::kFirst << (4 * pass);
    const float4* table = tw + 3 * P::table_offset(pass);
    const int t = thread_index();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int j = t + q * P::kThreads;
      k[q] = j & (Ns - 1);
      const int at = pad(j);
#pragma unroll
      for (int r = 0; r < 16; ++r) v[q][r] = ldp(at + r * padded_stride(M / 16));
      twiddle16(v[q], table + 3 * k[q]);
      dft16<false, kHalfOut>(v[q]);
      BEM_FFT_ORDER();
    }
  }

  // A middle radix-16 pass, shared memory to shared memory.
  BEM_FFT_FN void pass16(int pass) const {
    const int Ns = P::kFirst << (4 * pass);
    float2 v[2][16];
    int k[2];
    load16<false>(v, pass, k);
    __syncthreads();
    const int t = thread_index();
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int j = t + q * P::kThreads;
      const int base = (j - k[q]) * 16 + k[q];
      if (Ns >= 16) {  // a multiple of 16
        const int at = pad(base), stride = padded_stride(Ns);
#pragma unroll
        for (int r = 0; r < 16; ++r) stp(at + r * stride, v[q][r]);
      } else {
#pragma unroll
        for (int r = 0; r < 16; ++r) st(base + r * Ns, v[q][r]);
      }
    }
    __syncthreads();
  }

  // The last inverse pass (Ns = M/16): store(n, z, in) for n < M/2 with z = (x[2n], x[2n+1]) of the inverse
  // transform, still to be scaled, and in = store.fetch(n), the global inputs of those two outputs. With
  // Store::kWritesSmem the store may write buf (after a barrier). Returns the sum of what the stores return.
  //
  // The fetches of kFetchGroup outputs are issued before any of their stores: a store may alias the inputs
  // as far as the compiler knows, so fetching each output's inputs right before it serialised one global
  // latency per output, half the forward kernel's time (ncu, L 8192).
  template <class Store>
  BEM_FFT_FN double last_pass(const Store& store) const {
    constexpr int Ns = M / 16, G = Store::kFetchGroup;
    static_assert(8 % G == 0, "a fetch group divides a butterfly's 8 outputs");
    float2 v[2][16];
    int k[2];
    load16<true>(v, P::kPasses16 - 1, k);
    if (Store::kWritesSmem) __syncthreads();
    const int t = thread_index();
    double sum = 0.0;
#pragma unroll
    for (int q = 0; q < 2; ++q) {
      const int j = t + q * P::kThreads;  // j < Ns: the output index is j + r Ns
#pragma unroll
      for (int r0 = 0; r0 < 8; r0 += G) {
        typename Store::Inputs in[G];
#pragma unroll
        for (int i = 0; i < G; ++i) in[i] = store.fetch(j + (r0 + i) * Ns);
#pragma unroll
        for (int i = 0; i < G; ++i) sum += store(j + (r0 + i) * Ns, conj2(v[q][r0 + i]), in[i]);
      }
      BEM_FFT_ORDER();
    }
    if (Store::kWritesSmem) __syncthreads();
    return sum;
  }

  // A = Z[k], B = Z[kp] (kp = M - k; kp = M for k = 0, the Nyquist bin, where A and B are both Z[0]),
  // W = exp(-2 pi i k / 2M). op(k, kp, X2[k], X2[kp], S[k], S[kp], in, Y[k], Y[kp]) gets twice the real
  // signal's bins (X2 = 2X), with Op::kStaged the staged values of bins k and kp (stage()), and with
  // Op::kRetangle returns the bins of the inverse transform's real output, whose inputs at k and kp are
  // then written to buf (k = 0: only index 0). The caller has made those slots this thread's alone (a
  // barrier since the last reads of buf): writing each pair's result at once frees its registers, where
  // keeping all 16 pairs' results for one store phase spilled.
  template <class Op>
  BEM_FFT_FN void pair(float2 A, float2 B, float2 W, int k, int kp, const Op& op,
                       const typename Op::Inputs& in) const {
    const int at_k = pad(k), at_kp = pad(kp);  // base + constant after unrolling (pair_bins)
    const float2 Bc = conj2(B);
    const float2 xe = cadd(A, Bc);
    const float2 wxo = cmul(W, mul_neg_i(csub(A, Bc)));
    const float2 Xk = cadd(xe, wxo);
    const float2 Xkp = conj2(csub(xe, wxo));
    const float2 zero = make_float2(0.0f, 0.0f);
    float2 Yk, Ykp;
    op(k, kp, Xk, Xkp, Op::kStaged ? ld_ordered(at_k) : zero, Op::kStaged ? ld_ordered(at_kp) : zero, in, Yk, Ykp);
    if (Op::kRetangle) {
      const float2 Ykpc = conj2(Ykp);
      const float2 ye = cadd(Yk, Ykpc);
      const float2 yo = cmulc(csub(Yk, Ykpc), W);
      st_ordered(at_k, conj2(cadd(ye, mul_i(yo))));
      if (kp != k && kp < M) st_ordered(at_kp, cadd(ye, mul_neg_i(yo)));
    }
  }

  // One pair's operands: A = Z[k], B = Z[kp], W.
  struct PairAt {
    float2 A, B, W;
    int k, kp;
  };

  // The N pairs at(0) .. at(N-1) (i a compile-time constant after unrolling), Op::kFetchGroup at a time:
  // the op's global inputs of a group are all fetched before the first of its pairs (as in last_pass).
  template <int N, class Op, class At>
  BEM_FFT_FN void pair_group(const Op& op, const At& at) const {
    constexpr int G = Op::kFetchGroup;
#pragma unroll
    for (int i0 = 0; i0 < N; i0 += G) {
      typename Op::Inputs in[G];
#pragma unroll
      for (int i = 0; i < G; ++i) {
        if (i0 + i < N) {
          const PairAt p = at(i0 + i);
          in[i] = op.fetch(p.k, p.kp);
        }
      }
#pragma unroll
      for (int i = 0; i < G; ++i) {
        if (i0 + i < N) {
          const PairAt p = at(i0 + i);
          pair(p.A, p.B, p.W, p.k, p.kp, op, in[i]);
        }
      }
    }
  }

  // The bins of thread t's pairs: a[] holds butterfly j1 (bins j1 + r Ns), b[] butterfly j2. Thread t > 0
  // pairs bin t + r Ns (a[r]) with bin M - (t + r Ns) = (Ns - t) + (15 - r) Ns (b[15 - r]), r = 0 .. 15.
  // Thread 0 holds butterflies 0 and Ns/2, whose bins pair among themselves: in slots r <= 8 it pairs a[r]
  // with a[16 - r] (slot 0: bin 0 with the Nyquist bin M; slot 8: M/2 with itself), a select away from the
  // others' slots; then b's eight pairs instead of slots 9 .. 15. Warp 0 runs both of those last branches, 24
  // pairings: with a branch of thread 0's own for all of its 17 it ran 33 while the other warps waited, and
  // that code was a fifth of the backward kernel's (which waited on instruction fetches, ncu).
  template <class Op>
  BEM_FFT_FN void pair_bins(const float2 (&a)[16], const float2 (&b)[16], const Op& op) const {
    constexpr int Ns = M / 16;
    const int t = thread_index();
    const bool t0 = t == 0;
    const float2 base = pair_base[t];
    pair_group<9>(op, [&](int r) {
      return PairAt{a[r], t0 ? a[(16 - r) & 15] : b[15 - r], rotate32(base, r), t + r * Ns, (Ns - t) + (15 - r) * Ns};
    });
    if (!t0) {
      pair_group<7>(op, [&](int i) {
        const int r = 9 + i;
        return PairAt{a[r], b[15 - r], rotate32(base, r), t + r * Ns, (Ns - t) + (15 - r) * Ns};
      });
    } else {
      const float2 base2 = make_float2(0.99518472667219689f, -0.098017140329560602f);  // exp(-i pi / 32)
      pair_group<8>(op, [&](int r) {
        return PairAt{b[r], b[15 - r], rotate32(base2, r), Ns / 2 + r * Ns, Ns / 2 + (15 - r) * Ns};
      });
    }
  }

  BEM_FFT_FN void butterflies_of_pairs(int& j1, int& j2) const {
    constexpr int Ns = M / 16;
    const int t = thread_index();
    j1 = t;
    j2 = t == 0 ? Ns / 2 : Ns - t;
  }

  // Copies source[k] into buf at k for this thread's bins (all its pairs' k and kp), with no register: the
  // ops' S, 32 global loads per thread that the compiler hoisted into registers and spilled.
  BEM_FFT_FN void stage(const float2* source) const {
    constexpr int Ns = M / 16;
    int j1, j2;
    butterflies_of_pairs(j1, j2);
    const int at1 = pad(j1), at2 = pad(j2);
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      copy_async8(buf + at1 + r * padded_stride(Ns), source + j1 + r * Ns);
      copy_async8(buf + at2 + r * padded_stride(Ns), source + j2 + r * Ns);
    }
    if (j1 == 0) copy_async8(buf + pad(M), source + M);
  }

  // The last forward pass (Ns = M/16) with the pairing: op sees every bin 0..M once (M/2 as k = kp).
  template <class Op>
  BEM_FFT_FN void pair_pass(const Op& op) const {
    constexpr int Ns = M / 16;
    const float4* table = tw + 3 * P::table_offset(P::kPasses16 - 1);
    int j1, j2;
    butterflies_of_pairs(j1, j2);
    float2 a[16], b[16];
    {
      const int at1 = pad(j1), at2 = pad(j2);
#pragma unroll
      for (int r = 0; r < 16; ++r) {
        a[r] = ldp(at1 + r * padded_stride(Ns));
        b[r] = ldp(at2 + r * padded_stride(Ns));
      }
    }
    static_assert(Op::kStaged || !Op::kRetangle, "an op that writes the inverse's inputs stages (a barrier)");
    if (Op::kStaged) {
      __syncthreads();  // every thread's reads done: its bins' slots are its own now
      stage(op.staged);
    }
#pragma unroll
    for (int r = 0; r < 16; ++r) op.prefetch(j1 + r * Ns, j2 + r * Ns);
    twiddle16(a, table + 3 * j1);
    dft16<false, false>(a);
    BEM_FFT_ORDER();
    twiddle16(b, table + 3 * j2);
    dft16<false, false>(b);
    if (Op::kStaged) wait_async_copies();  // a thread reads only the bins it staged: no barrier
    pair_bins(a, b, op);
    if (Op::kRetangle) __syncthreads();
  }

  // The pairing alone, on bins the op produces (no forward transform): fills buf for an inverse.
  template <class Op>
  BEM_FFT_FN void pair_only(const Op& op) const {
    float2 a[16], b[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) a[r] = b[r] = make_float2(0.0f, 0.0f);
    __syncthreads();  // the last reads of buf done
    pair_bins(a, b, op);
    __syncthreads();
  }

  BEM_FFT_FN void middle_passes_here() const {
    // a loop the compiler cannot count (thread_index() >> 30 is 0): with one middle pass (M <= 4096) it
    // otherwise became straight-line code with the passes around it, 219 registers against 128 at M = 1024
    const int passes = P::kPasses16 - 1 + (thread_index() >> 30);
#pragma unroll 1
    for (int pass = 0; pass < passes; ++pass) pass16(pass);
  }
  BEM_FFT_FN void middle_passes() const;

  // forward transform of load's z (zero past M/2), then op on the bins
  template <class Load, class Op>
  BEM_FFT_FN void forward(const Load& load, const Op& op) const {
    first_pass<true>(load);
    middle_passes();
    pair_pass(op);
  }

  // inverse transform of what pair_pass / pair_only left in buf, into store; the sum of the store's returns
  template <class Store>
  BEM_FFT_FN double inverse(const Store& store) const {
    first_pass<false>([this](int, int padded) { return ldp(padded); });
    middle_passes();
    return last_pass(store);
  }
};

// The middle passes as one function that every transform of a kernel calls: inlined at each call site,
// the backward kernel's code outgrew the instruction cache (ncu: 43% of its stalls waiting for instructions).
#if defined(__CUDACC__)
#define BEM_FFT_SHARED_CODE __device__ __noinline__
#else
#define BEM_FFT_SHARED_CODE inline
#endif
template <int M>
BEM_FFT_SHARED_CODE void middle_passes_of(float4* smem) {
  BlockFft<M>(smem).middle_passes_here();
}
template <int M>
BEM_FFT_FN void BlockFft<M>::middle_passes() const {
  middle_passes_of<M>(reinterpret_cast<float4*>(buf));
}

// ---------------------------------------------------------------------------------------------------
// element types

BEM_FFT_FN float to_f(float v) { return v; }
template <typename T> BEM_FFT_FN T from_f(float v);
template <> BEM_FFT_FN float from_f<float>(float v) { return v; }
#if defined(__CUDACC__)
BEM_FFT_FN float to_f(__half v) { return __half2float(v); }
BEM_FFT_FN float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <> BEM_FFT_FN __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> BEM_FFT_FN __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
#endif

// exact GELU and its derivative
BEM_FFT_FN float gelu_f(float x) { return 0.5f * x * (1.0f + erff(x * 0.70710678118654752f)); }
BEM_FFT_FN float gelu_grad_f(float x) {
  const float cdf = 0.5f * (1.0f + erff(x * 0.70710678118654752f));
  return cdf + x * 0.39894228040143268f * expf(-0.5f * x * x);
}

// z[n] = (x[2n], x[2n+1]), x = a ⊙ gate (gate may be null), zero past L
template <typename T>
struct GatedLoad {
  const T* a;
  const T* gate;
  int L;
  BEM_FFT_FN float value(int m) const {
    if (m >= L) return 0.0f;
    const float x = to_f(a[m]);
    return gate ? x * to_f(gate[m]) : x;
  }
  BEM_FFT_FN float2 operator()(int n, int) const { return make_float2(value(2 * n), value(2 * n + 1)); }
};

}  // namespace fftconv
}  // namespace bem
