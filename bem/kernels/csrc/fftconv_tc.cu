// The tensor-core forward of the fftconv op for bfloat16 rows, 1024 <= M <= 8192 (a complex FFT of N = 2M
// points), Hopper and later. scripts/fftconv_tc_model.py is its lane-level model (same positions, fragments,
// twiddles and roundings), checked against a float64 convolution.
//
// Two batch rows of one head go through one complex FFT, z = s1 v1 + i s2 v2 (v = pregate ⊙ u, s a power of two
// per row that brings its largest value into (0.5, 1]): the filter is real, so the inverse transform of Z ⊙ K
// holds both convolutions, one in each part. z lives in shared memory as float16 real and imaginary planes.
// N = r 16^a: one radix-r pass on the CUDA cores with the loads (decimation in frequency), radix-16 passes as
// mma.m16n8k16 products with the DFT-16 / 4 (the last two of the forward, the product with the filter's spectrum
// and the first two of the inverse on one 256-point block a warp, in registers: movmatrix transposes between
// them), the inverse passes in reverse order (decimation in time: the spectrum stays in digit-reversed order, the
// filter's is gathered into that order), and the inverse radix-r pass with the epilogue. Every pass is unitary,
// so values stay within float16's range; float32 in registers.
// float16 operands hold bfloat16 rows to PyTorch's error (the model: 1.04-1.21x); float16 rows would not
// (3-4x), so they, float32 rows and other lengths keep the block kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "fftconv.h"
#include "fftconv_block.cuh"
#include "fftconv_tc_fragments.cuh"

namespace bem {
namespace fftconv {
namespace {

using namespace tc;  // the warp-level pieces (fftconv_tc_fragments.cuh)

constexpr int kPipeThreads = 256;  // one pipeline: 8 warps convolve one pair of rows at a time
constexpr int kPipes = 2;          // pipelines a block, sharing the head's filter spectrum
constexpr int kThreads = kPipeThreads * kPipes;
constexpr int kPipeWarps = kPipeThreads / 32;

template <int N>
struct TcShape {
  static constexpr int kA = N % 4096 == 0 ? 3 : 2;             // radix-16 passes
  static constexpr int kR = N / (kA == 3 ? 4096 : 256);       // the CUDA-core pass's radix
  static constexpr int kS0 = N / kR;                           // its stride
  static constexpr int kTiles = N / 256;                       // 16 x 16 points a warp's tile
  static constexpr int kPlaneBytes = 2 * N;                    // float16
  static constexpr int kSpectrumOffset = kPipes * 2 * kPlaneBytes;
  static constexpr int kTablesOffset = kSpectrumOffset + 4 * N;  // half2 a bin
  static constexpr int kScratchOffset = kTablesOffset + 2 * 256 * 8;
  static constexpr int kSmemBytes = kScratchOffset + kPipes * kPipeWarps * 2 * 4 + 32 * 4;
  static_assert(kR == 1 || kR == 2 || kR == 4 || kR == 8, "N = r 16^a");
};

// 16-byte chunks of a plane XOR-swizzled so that eight rows of every pass's ldmatrix and stmatrix (strides of
// 16 and 256 points, and groups of 16) fall in eight different bank groups (checked for every pass in the model).
__device__ __forceinline__ int swz(int p) {
  const int c = p >> 3, a = c >> 3;
  return ((c ^ (((a >> 2) ^ (a & 1)) & 7)) << 3) | (p & 7);
}

// z W_8^m, m known at compile time after unrolling: swaps and negations, or two products by 1 / sqrt(2)
__device__ __forceinline__ float2 mulw8(float2 z, int m) {
  constexpr float c = 0.70710678118654752f;
  switch (m & 7) {
    case 0: return z;
    case 1: return make_float2(c * (z.x + z.y), c * (z.y - z.x));
    case 2: return make_float2(z.y, -z.x);
    case 3: return make_float2(c * (z.y - z.x), -c * (z.x + z.y));
    case 4: return make_float2(-z.x, -z.y);
    case 5: return make_float2(-c * (z.x + z.y), c * (z.x - z.y));
    case 6: return make_float2(-z.y, z.x);
    default: return make_float2(c * (z.x - z.y), c * (z.x + z.y));
  }
}

__device__ __forceinline__ void pipe_sync(int pipe) {
  asm volatile("bar.sync %0, %1;" ::"r"(1 + pipe), "r"(kPipeThreads) : "memory");
}

struct TcParams {
  const __nv_bfloat16* u;
  const __nv_bfloat16* pregate;
  const __nv_bfloat16* postgate;
  const float2* S;  // (H, M + 1), rfft's order
  const float* D;
  __nv_bfloat16* y;
  int B, H, L, chunks;
  bool gelu;
  bool vec;  // 16-byte accesses: L a multiple of 8 and every row pointer 16-byte aligned
};

template <int N>
struct TcBlock {
  using Shape = TcShape<N>;
  static constexpr int kA = Shape::kA, kR = Shape::kR, kS0 = Shape::kS0, kTiles = Shape::kTiles;

  __half* re;
  __half* im;
  uint32_t* spectrum;  // half2 bins in the fused pass's fragment order: [tile][2][lane] x 4
  const float2* w256;  // W_256^m, m < 256
  const float2* w4096; // W_4096^m, m < 256
  float* scratch;      // this pipeline's partial maxima
  int lane, warp, tid;

  // the frequency the forward passes leave at position p = q0 s0 + d1 16^(a-1) + ... + da: f = q0 + r (d1 + 16 d2
  // [+ 256 d3])
  static __device__ int frequency(int p) {
    const int q0 = p / kS0, rest = p % kS0;
    if (kA == 3) return q0 + kR * ((rest >> 8) + 16 * ((rest >> 4) & 15) + 256 * (rest & 15));
    return q0 + kR * ((rest >> 4) + 16 * (rest & 15));
  }

  template <int kN>
  __device__ uint32_t strided_addr(int tile) const {
    constexpr int s = kN / 16, per_block = s / 16;
    const int b = tile / per_block, j1 = tile % per_block;
    const int m = lane >> 3, i = lane & 7;
    return smem_addr(re + swz(b * kN + 16 * j1 + 8 * (m & 1) + (i + 8 * (m >> 1)) * s));
  }
  static constexpr uint32_t kImOffset = 2 * N;  // bytes from the real plane to the imaginary one

  // this lane's W_n^{±row col} (n = 256 or 4096: row col <= 225 stays inside the tables), per (n-tile, element)
  __device__ void lane_twiddles(const float2* table, bool conjugate, float2 (&tw)[2][4]) const {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 w = table[c_row(lane, e) * c_col(lane, nt, e)];
        tw[nt][e] = conjugate ? conj2(w) : w;
      }
  }

  // The radix-16 pass over blocks of 4096 points (stride 256): forward, with its output twiddles
  // W_4096^{(16 j1 + row) col} = W_4096^{row col} W_256^{j1 col} (the second factor per column), or inverse.
  template <bool kInverse>
  __device__ void outer_pass(const Dft16& w) const {
    float2 tw[2][4];
    if (!kInverse) lane_twiddles(w4096, false, tw);
    const int c0 = (lane & 3) * 2;
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = strided_addr<4096>(tile), a_im = a_re + kImOffset;
      uint32_t ar[4], ai[4];
      ldsm_x4(a_re, ar, true);
      ldsm_x4(a_im, ai, true);
      float cr[2][4], ci[2][4];
      dft_tile<kInverse>(ar, ai, w, cr, ci);
      if (!kInverse) {
        const int j1 = tile & 15;
        float2 col_tw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) col_tw[i] = w256[(j1 * (c0 + (i & 1) + 8 * (i >> 1))) & 255];
        twiddle_tile(cr, ci, lane, [&](int nt, int e) { return cmul(tw[nt][e], col_tw[(e & 1) + 2 * nt]); });
      }
      store_tile(a_re, cr, ci);
    }
  }

  __device__ static void store_tile(uint32_t a_re, const float (&cr)[2][4], const float (&ci)[2][4]) {
    uint32_t r[4];
    pack_tile(cr, r);
    stsm_x4(a_re, r, true);
    pack_tile(ci, r);
    stsm_x4(a_re + kImOffset, r, true);
  }

  // One 256-point block a tile, in registers from its load to its store: the forward radix-16 pass of stride 16
  // (its twiddles W_256^{jq}), the last forward pass on the block's 16 groups (C transposed into the next A by
  // movmatrix), the product with the spectrum, the first inverse pass, its twiddles for the inverse pass of
  // stride 16, that pass (transposed again) and, with a pass of 4096 after it, that pass's input twiddles
  // W_4096^{-(row + 16 col) qb} = conj(W_4096^{row qb} W_256^{col qb}), qb = the block's index mod 16.
  __device__ void block_pass(const Dft16& w) const {
    float2 tw[2][4];
    lane_twiddles(w256, false, tw);
    uint32_t twr[4], twi[4], conj_twi[4];
    pair_twiddles(tw, twr, twi);
#pragma unroll
    for (int i = 0; i < 4; ++i) conj_twi[i] = twi[i] ^ 0x80008000u;
    const int c0 = (lane & 3) * 2;
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = strided_addr<256>(tile), a_im = a_re + kImOffset;
      const uint4 k0 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2) * 32 + lane];
      const uint4 k1 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2 + 1) * 32 + lane];
      uint32_t ar[4], ai[4], pr[4], pi[4];
      ldsm_x4(a_re, ar, true);
      ldsm_x4(a_im, ai, true);
      float cr[2][4], ci[2][4];
      dft_tile<false>(ar, ai, w, cr, ci);
      pack_tile(cr, pr);
      pack_tile(ci, pi);
      twiddle_pairs(pr, pi, twr, twi);
      transposed_a(pr, ar);
      transposed_a(pi, ai);
      dft_tile<false>(ar, ai, w, cr, ci);
      pack_tile(cr, ar);
      pack_tile(ci, ai);
      const uint32_t kr[4] = {k0.x, k0.z, k1.x, k1.z}, ki[4] = {k0.y, k0.w, k1.y, k1.w};
      twiddle_pairs(ar, ai, kr, ki);
      dft_tile<true>(ar, ai, w, cr, ci);
      pack_tile(cr, pr);
      pack_tile(ci, pi);
      twiddle_pairs(pr, pi, twr, conj_twi);
      transposed_a(pr, ar);
      transposed_a(pi, ai);
      dft_tile<true>(ar, ai, w, cr, ci);
      if (kA == 3) {
        const int qb = tile & 15;
        const float2 row_tw[2] = {w4096[(lane >> 2) * qb], w4096[((lane >> 2) + 8) * qb]};
        float2 col_tw[4];
#pragma unroll
        for (int i = 0; i < 4; ++i) col_tw[i] = w256[((c0 + (i & 1) + 8 * (i >> 1)) * qb) & 255];
        twiddle_tile(cr, ci, lane,
                     [&](int nt, int e) { return conj2(cmul(row_tw[e >> 1], col_tw[(e & 1) + 2 * nt])); });
      }
      store_tile(a_re, cr, ci);
    }
  }

  // the pipeline's largest |value| of two rows, each reduced over its 8 warps
  __device__ float2 pipe_max(float2 m, int pipe) const {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m.x = fmaxf(m.x, __shfl_xor_sync(0xffffffffu, m.x, o));
      m.y = fmaxf(m.y, __shfl_xor_sync(0xffffffffu, m.y, o));
    }
    if (lane == 0) {
      scratch[2 * warp] = m.x;
      scratch[2 * warp + 1] = m.y;
    }
    pipe_sync(pipe);
    float2 out = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kPipeWarps; ++i) {
      out.x = fmaxf(out.x, scratch[2 * i]);
      out.y = fmaxf(out.y, scratch[2 * i + 1]);
    }
    return out;
  }
};

// a power of two bringing m into (0.5, 1]; 1 for 0 (and for values that are not finite)
__device__ __forceinline__ float unit_scale(float m) {
  if (!(m > 0.f) || !isfinite(m)) return 1.f;
  int e;
  frexpf(m, &e);  // m = f 2^e, f in [0.5, 1)
  return ldexpf(1.f, -e);
}

__device__ __forceinline__ void unpack_bf16x8(const uint4& w, float (&out)[8]) {
  const uint32_t words[4] = {w.x, w.y, w.z, w.w};
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 f = __bfloat1622float2(*reinterpret_cast<const __nv_bfloat162*>(&words[i]));
    out[2 * i] = f.x;
    out[2 * i + 1] = f.y;
  }
}

// V values of `row` from `at` (zero past L): one 16-byte load where the rows are aligned and all V lie inside
template <int V>
__device__ __forceinline__ void load_row(const __nv_bfloat16* base, int64_t row, int at, int L, bool vec,
                                         float (&out)[V]) {
  if constexpr (V == 8) {
    if (vec && at + 8 <= L) {
      unpack_bf16x8(*reinterpret_cast<const uint4*>(base + row + at), out);
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e) out[e] = at + e < L ? __bfloat162float(base[row + at + e]) : 0.f;
}

template <int V>
__device__ __forceinline__ void load_gated(const TcParams& p, int64_t row, int at, bool vec, float (&v)[V]) {
  load_row<V>(p.u, row, at, p.L, vec, v);
  if (p.pregate) {
    float g[V];
    load_row<V>(p.pregate, row, at, p.L, vec, g);
#pragma unroll
    for (int e = 0; e < V; ++e) v[e] *= g[e];
  }
}

template <int V>
__device__ __forceinline__ void store_row(__nv_bfloat16* base, int64_t row, int at, int L, bool vec,
                                          const float (&y)[V]) {
  if constexpr (V == 8) {
    if (vec && at + 8 <= L) {
      uint4 w;
      uint32_t* words = reinterpret_cast<uint32_t*>(&w);
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const __nv_bfloat162 b = __floats2bfloat162_rn(y[2 * i], y[2 * i + 1]);
        words[i] = *reinterpret_cast<const uint32_t*>(&b);
      }
      *reinterpret_cast<uint4*>(base + row + at) = w;
      return;
    }
  }
#pragma unroll
  for (int e = 0; e < V; ++e)
    if (at + e < L) base[row + at + e] = __float2bfloat16_rn(y[e]);
}

// V consecutive float16 values from src to dst, one 16-byte access where V is 8 (between a plane and registers)
template <int V>
__device__ __forceinline__ void copy_halves(__half* dst, const __half* src) {
  if constexpr (V == 8) {
    *reinterpret_cast<uint4*>(dst) = *reinterpret_cast<const uint4*>(src);
  } else {
#pragma unroll
    for (int e = 0; e < V; ++e) dst[e] = src[e];
  }
}

// The CUDA-core passes: each thread takes V consecutive j of the radix-r pass at a time (16-byte accesses)
template <int N>
struct Simt {
  static constexpr int kR = TcShape<N>::kR, kS0 = TcShape<N>::kS0;
  static constexpr int kV = kS0 / kPipeThreads < 8 ? kS0 / kPipeThreads : 8;
  static constexpr int kChunks = kS0 / (kV * kPipeThreads);
  static constexpr int kLive = kR > 1 ? kR / 2 : 1;  // L <= N / 2: the upper half of the inputs is zero
  static_assert(kV >= 1 && kChunks * kV * kPipeThreads == kS0, "the radix-r pass's split");

  static __device__ int first_j(int tid, int chunk) { return (chunk * kPipeThreads + tid) * kV; }

  // W_N^{±j}
  static __device__ float2 root(int j, bool inverse) {
    float s, c;
    __sincosf((inverse ? 6.283185307179586f : -6.283185307179586f) * (float)j / (float)N, &s, &c);
    return make_float2(c, s);
  }

  // the rows' values at this thread's points of one chunk (zero for an absent second row), and their maxima
  static __device__ void load_chunk(const TcParams& p, int64_t row1, int64_t row2, bool two, int tid, bool vec,
                                    int chunk, float (&a)[kLive][kV], float (&b)[kLive][kV], float2& m) {
#pragma unroll
    for (int t = 0; t < kLive; ++t) {
      const int at = first_j(tid, chunk) + t * kS0;
      load_gated<kV>(p, row1, at, vec, a[t]);
      if (two) load_gated<kV>(p, row2, at, vec, b[t]);
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        if (!two) b[t][e] = 0.f;
        m.x = fmaxf(m.x, fabsf(a[t][e]));
        m.y = fmaxf(m.y, fabsf(b[t][e]));
      }
    }
  }

  // one chunk's y_q = r^-1/2 sum_t x_t W_r^{tq} W_N^{jq} at j + q s0 of the planes, x = (s1 v1, s2 v2)
  static __device__ void transform_chunk(const float (&a)[kLive][kV], const float (&b)[kLive][kV], float s1,
                                         float s2, int j0, __half* re, __half* im) {
    const float norm = rsqrtf((float)kR);
    __half yr[kR][kV], yi[kR][kV];
#pragma unroll
    for (int e = 0; e < kV; ++e) {
      const float2 w1 = kR > 1 ? root(j0 + e, false) : make_float2(1.f, 0.f);
      float2 wq = make_float2(norm, 0.f);
#pragma unroll
      for (int q = 0; q < kR; ++q) {
        float2 y = make_float2(a[0][e] * s1, b[0][e] * s2);
#pragma unroll
        for (int t = 1; t < kLive; ++t) y = cadd(y, mulw8(make_float2(a[t][e] * s1, b[t][e] * s2), t * q * (8 / kR)));
        y = cmul(y, wq);
        wq = cmul(wq, w1);
        yr[q][e] = __float2half_rn(y.x);
        yi[q][e] = __float2half_rn(y.y);
      }
    }
#pragma unroll
    for (int q = 0; q < kR; ++q) {
      const int at = swz(j0 + q * kS0);
      copy_halves<kV>(re + at, yr[q]);
      copy_halves<kV>(im + at, yi[q]);
    }
  }

  // The radix-r pass from the rows; each row's largest |v| through `reduce` (the pipeline's maxima) gives its scale
  // s. The rows' values stay in registers between the maxima and the pass where they fit (up to 16 a row and
  // thread), else they are loaded again (from L1 or L2).
  template <typename Reduce>
  static __device__ void forward(const TcParams& p, int64_t row1, int64_t row2, bool two, __half* re, __half* im,
                                 int tid, bool vec, Reduce&& reduce, float& s1, float& s2) {
    constexpr bool kHold = kChunks * kLive * kV <= 16;
    float a[kHold ? kChunks : 1][kLive][kV], b[kHold ? kChunks : 1][kLive][kV];
    float2 m = make_float2(0.f, 0.f);
#pragma unroll
    for (int chunk = 0; chunk < kChunks; ++chunk) load_chunk(p, row1, row2, two, tid, vec, chunk,
                                                             a[kHold ? chunk : 0], b[kHold ? chunk : 0], m);
    const float2 mx = reduce(m);
    s1 = unit_scale(mx.x);
    s2 = unit_scale(mx.y);
#pragma unroll
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      if (!kHold) load_chunk(p, row1, row2, two, tid, vec, chunk, a[0], b[0], m);
      transform_chunk(a[kHold ? chunk : 0], b[kHold ? chunk : 0], s1, s2, first_j(tid, chunk), re, im);
    }
  }

  // the inverse: x_q = W_N^{-jq} z_q, y_t = r^-1/2 sum_q x_q W_r^{-tq}; then the epilogue on both rows (D v
  // came through the transforms: the spectrum is S + D)
  static __device__ void inverse(const TcParams& p, int64_t row1, int64_t row2, bool two, float un1, float un2,
                                 const __half* re, const __half* im, int tid, bool vec) {
    const float norm = rsqrtf((float)kR);
#pragma unroll 1
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      const int j0 = first_j(tid, chunk);
      __half zr[kR][kV], zi[kR][kV];
#pragma unroll
      for (int q = 0; q < kR; ++q) {
        const int at = swz(j0 + q * kS0);
        copy_halves<kV>(zr[q], re + at);
        copy_halves<kV>(zi[q], im + at);
      }
      float o1[kLive][kV], o2[kLive][kV];
#pragma unroll
      for (int e = 0; e < kV; ++e) {
        const float2 w1 = kR > 1 ? root(j0 + e, true) : make_float2(1.f, 0.f);
        float2 x[kR];
        float2 wq = make_float2(norm, 0.f);
#pragma unroll
        for (int q = 0; q < kR; ++q) {
          x[q] = cmul(make_float2(__half2float(zr[q][e]), __half2float(zi[q][e])), wq);
          wq = cmul(wq, w1);
        }
#pragma unroll
        for (int t = 0; t < kLive; ++t) {
          float2 y = x[0];
#pragma unroll
          for (int q = 1; q < kR; ++q) y = cadd(y, mulw8(x[q], -t * q * (8 / kR)));
          o1[t][e] = y.x * un1;
          o2[t][e] = y.y * un2;
        }
      }
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        const int at = j0 + t * kS0;
        if (at >= p.L) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !two) break;
          const int64_t row = r == 0 ? row1 : row2;
          float post[kV], y[kV];
          if (p.postgate) load_row<kV>(p.postgate, row, at, p.L, vec, post);
#pragma unroll
          for (int e = 0; e < kV; ++e) {
            float c = r == 0 ? o1[t][e] : o2[t][e];
            if (p.gelu) c = gelu_f(c);
            y[e] = p.postgate ? c * post[e] : c;
          }
          store_row<kV>(p.y, row, at, p.L, vec, y);
        }
      }
    }
  }
};

template <int N>
__global__ void __launch_bounds__(kThreads, 1) tc_forward_kernel(const TcParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = TcShape<N>;
  using Block = TcBlock<N>;
  using Pass = Simt<N>;
  constexpr int kM = N / 2;
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = blockIdx.x / p.chunks, chunk = blockIdx.x % p.chunks;
  const int pairs = (p.B + 1) / 2;
  const int per_chunk = (pairs + p.chunks - 1) / p.chunks;
  const int first = chunk * per_chunk, last = min(pairs, first + per_chunk);
  const int pipe = threadIdx.x / kPipeThreads;

  Block blk;
  blk.re = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes);
  blk.im = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes + Shape::kPlaneBytes);
  blk.spectrum = reinterpret_cast<uint32_t*>(smem + Shape::kSpectrumOffset);
  float2* w256 = reinterpret_cast<float2*>(smem + Shape::kTablesOffset);
  float2* w4096 = w256 + 256;
  blk.w256 = w256;
  blk.w4096 = w4096;
  float* scratch = reinterpret_cast<float*>(smem + Shape::kScratchOffset);
  blk.scratch = scratch + pipe * kPipeWarps * 2;
  blk.tid = threadIdx.x % kPipeThreads;
  blk.lane = threadIdx.x & 31;
  blk.warp = blk.tid >> 5;
  float* block_scratch = scratch + kPipes * kPipeWarps * 2;
  const int L = p.L;
  auto row_of = [&](int b) { return ((int64_t)b * p.H + h) * L; };
  if (first + pipe < last) {  // this pipeline's first pair into L2 while the spectrum is gathered
    prefetch_row_l2(p.u + row_of(2 * (first + pipe)), 2 * (int64_t)L, blk.tid, kPipeThreads);
    if (p.pregate) prefetch_row_l2(p.pregate + row_of(2 * (first + pipe)), 2 * (int64_t)L, blk.tid, kPipeThreads);
  }

  // twiddle tables and the head's spectrum, scaled into float16, in the fused pass's fragment order
  {
    const int t = threadIdx.x & 255;
    float s, c;
    sincospif((float)t / (threadIdx.x < 256 ? 128.f : 2048.f), &s, &c);
    (threadIdx.x < 256 ? w256 : w4096)[t] = make_float2(c, -s);
  }
  // the head's spectrum S + D (D v as a tap at lag 0), staged in rfft's order in the pipelines' planes (free until
  // the first pair), then each thread's four fragment slots gathered from there: frequency f of the fused pass's
  // position, conj(S[N - f]) above M. The staging XOR-swizzles bits 0-3 of f with the bits the lanes of one gather
  // differ in (the model's search: no bank conflict in either step).
  const float2* S = p.S + (int64_t)h * (kM + 1);
  const float D = p.D ? p.D[h] : 0.f;
  float2* staged = reinterpret_cast<float2*>(smem);
  constexpr int kLog = (Shape::kR == 1 ? 0 : Shape::kR == 2 ? 1 : Shape::kR == 4 ? 2 : 3) + 4 * (Shape::kA - 2) + 4;
  auto stage = [](int f) { return f ^ (((f >> kLog) & 7) | (((f >> (kLog + 5)) & 1) << 3)); };
  constexpr int kPerThread = (kM + 1 + kThreads - 1) / kThreads;
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int f = threadIdx.x + i * kThreads;
    if (f <= kM) {
      const float2 v = make_float2(S[f].x + D, S[f].y);
      m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));
      staged[stage(f)] = v;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) block_scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, block_scratch[i]);
  const float sk = unit_scale(m);
  for (int g = threadIdx.x; g < N / 4; g += kThreads) {  // uint4 g: tile, n-tile, lane
    const int lane = g & 31, vh = (g >> 5) & 1, tile = g >> 6;
    float2 k[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = c_row(lane, e), col = c_col(lane, vh, e);
      const int f = Block::frequency(16 * (16 * tile + row) + col);
      const float2 v = staged[stage(f <= kM ? f : N - f)];
      k[e] = make_float2(v.x * sk, f <= kM ? v.y * sk : -v.y * sk);
    }
    // the block pass's pairs: real parts of elements 0 and 1, their imaginary parts, then elements 2 and 3
    reinterpret_cast<uint4*>(blk.spectrum)[g] = make_uint4(pack_half2(k[0].x, k[1].x), pack_half2(k[0].y, k[1].y),
                                                           pack_half2(k[2].x, k[3].x), pack_half2(k[2].y, k[3].y));
  }
  __syncthreads();

  const Dft16 dft(blk.lane);
  for (int pair = first + pipe; pair < last; pair += kPipes) {
    const int b1 = 2 * pair;
    const bool two = b1 + 1 < p.B;
    const int64_t row1 = row_of(b1), row2 = row_of(b1 + 1);
    float s1, s2;
    Pass::forward(p, row1, row2, two, blk.re, blk.im, blk.tid, p.vec,
                  [&](float2 m) { return blk.pipe_max(m, pipe); }, s1, s2);
    pipe_sync(pipe);
    // the postgate's rows the epilogue reads, and the next pair's inputs, into L2 while the tensor cores work
    const int rows_here = two ? 2 : 1;
    const int next = pair + kPipes < last ? min(2, p.B - 2 * (pair + kPipes)) : 0;
    if (p.postgate) prefetch_row_l2(p.postgate + row1, (int64_t)rows_here * L, blk.tid, kPipeThreads);
    if (next > 0) {
      prefetch_row_l2(p.u + row_of(b1 + 2 * kPipes), (int64_t)next * L, blk.tid, kPipeThreads);
      if (p.pregate) prefetch_row_l2(p.pregate + row_of(b1 + 2 * kPipes), (int64_t)next * L, blk.tid, kPipeThreads);
    }
    if (Shape::kA == 3) {
      blk.template outer_pass<false>(dft);
      pipe_sync(pipe);
    }
    blk.block_pass(dft);
    pipe_sync(pipe);
    if (Shape::kA == 3) {
      blk.template outer_pass<true>(dft);
      pipe_sync(pipe);
    }
    Pass::inverse(p, row1, row2, two, 1.f / (s1 * sk), 1.f / (s2 * sk), blk.re, blk.im, blk.tid, p.vec);
    pipe_sync(pipe);  // the next pair's first pass overwrites the planes
  }
#endif
}

template <int N>
cudaError_t launch_tc(const TcForwardArgs& a, int num_sms, cudaStream_t stream) {
  constexpr int kSmem = TcShape<N>::kSmemBytes;
  auto kernel = tc_forward_kernel<N>;
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem) != cudaSuccess)
    return cudaErrorInvalidConfiguration;
  int resident = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&resident, kernel, kThreads, kSmem) != cudaSuccess ||
      resident == 0)
    return cudaErrorInvalidConfiguration;
  // a block per head and chunk of its row pairs: chunks only where the heads alone would not fill the GPU
  const int pairs = (a.B + 1) / 2;
  const int64_t wanted = ((int64_t)resident * num_sms + a.H - 1) / a.H;
  const int chunks = (int)std::max<int64_t>(1, std::min<int64_t>((pairs + kPipes - 1) / kPipes, wanted));
  auto aligned = [](const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec = a.L % 8 == 0 && aligned(a.u) && aligned(a.pregate) && aligned(a.postgate) && aligned(a.y);
  const TcParams p{static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate),
                   static_cast<const __nv_bfloat16*>(a.postgate), a.S, a.D, static_cast<__nv_bfloat16*>(a.y),
                   a.B, a.H, a.L, chunks, a.gelu, vec};
  kernel<<<(unsigned)(a.H * chunks), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool tc_forward_takes(Dtype dtype, int M, int cc_major, int smem_optin) {
  if (dtype != Dtype::kBFloat16 || cc_major < 9) return false;
  switch (M) {
    case 1024: return TcShape<2048>::kSmemBytes <= smem_optin;
    case 2048: return TcShape<4096>::kSmemBytes <= smem_optin;
    case 4096: return TcShape<8192>::kSmemBytes <= smem_optin;
    case 8192: return TcShape<16384>::kSmemBytes <= smem_optin;
    default: return false;
  }
}

cudaError_t launch_tc_forward(int M, const TcForwardArgs& args, int num_sms, cudaStream_t stream) {
  switch (M) {
    case 1024: return launch_tc<2048>(args, num_sms, stream);
    case 2048: return launch_tc<4096>(args, num_sms, stream);
    case 4096: return launch_tc<8192>(args, num_sms, stream);
    case 8192: return launch_tc<16384>(args, num_sms, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace fftconv
}  // namespace bem
