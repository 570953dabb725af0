// The tensor-core forward of the fftconv op for bfloat16 rows, 1024 <= M <= 8192 (a complex FFT of N = 2M
// points), Hopper and later. scripts/fftconv_tc_model.py is its lane-level model (same positions, fragments,
// twiddles and roundings), checked against a float64 convolution.
//
// Two batch rows of one head go through one complex FFT, z = s1 v1 + i s2 v2 (v = pregate ⊙ u, s a power of two
// per row that brings its largest value into (0.5, 1]): the filter is real, so the inverse transform of Z ⊙ K
// holds both convolutions, one in each part. z lives in shared memory as float16 real and imaginary planes.
// N = r 16^a: one radix-r pass on the CUDA cores with the loads (decimation in frequency), a - 1 radix-16 passes
// as mma.m16n8k16 products with the DFT-16 / 4, the last radix-16 pass, the product with the filter's spectrum
// and the inverse's first pass in registers, the inverse passes in reverse order (decimation in time: the
// spectrum stays in digit-reversed order, the filter's is gathered into that order), and the inverse radix-r
// pass with the epilogue. Every pass is unitary, so values stay within float16's range; float32 in registers.
// float16 operands hold bfloat16 rows to PyTorch's error (the model: 1.04-1.11x); float16 rows would not
// (3-4x), so they, float32 rows and other lengths keep the block kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "fftconv.h"
#include "fftconv_block.cuh"

namespace bem {
namespace fftconv {
namespace {

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

__device__ __forceinline__ uint32_t smem_addr(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

__device__ __forceinline__ void ldsm_x4(uint32_t addr, uint32_t (&r)[4], bool trans) {
  if (trans)
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
  else
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(addr));
}

__device__ __forceinline__ void stsm_x4(uint32_t addr, const uint32_t (&r)[4], bool trans) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  if (trans)
    asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
  else
    asm volatile("stmatrix.sync.aligned.m8n8.x4.shared.b16 [%0], {%1,%2,%3,%4};"
                 :: "r"(addr), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
}

__device__ __forceinline__ void mma16816(float (&c)[4], const uint32_t (&a)[4], const uint32_t (&b)[2]) {
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
               "{%0,%1,%2,%3};"
               : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

__device__ __forceinline__ float2 unpack_half2(uint32_t v) {
  return __half22float2(*reinterpret_cast<const __half2*>(&v));
}

// W_8^m, m known at compile time after unrolling
__device__ __forceinline__ float2 w8(int m) {
  constexpr float c = 0.70710678118654752f;
  switch (m & 7) {
    case 0: return make_float2(1.f, 0.f);
    case 1: return make_float2(c, -c);
    case 2: return make_float2(0.f, -1.f);
    case 3: return make_float2(-c, -c);
    case 4: return make_float2(-1.f, 0.f);
    case 5: return make_float2(-c, c);
    case 6: return make_float2(0.f, 1.f);
    default: return make_float2(c, c);
  }
}

// The DFT-16 / 4 as mma B fragments (k = input index, n = output index), n-tiles 0 and 1: real part,
// imaginary part and its negation.
struct Dft16 {
  uint32_t re[2][2], im[2][2], neg_im[2][2];
  __device__ explicit Dft16(int lane) {
    const int n = lane >> 2, k = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float c[2], s[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) sincospif((float)(((k + 8 * half + e) * (n + 8 * nt)) & 15) / 8.f, &s[e], &c[e]);
        re[nt][half] = pack_half2(0.25f * c[0], 0.25f * c[1]);
        im[nt][half] = pack_half2(-0.25f * s[0], -0.25f * s[1]);
        neg_im[nt][half] = pack_half2(0.25f * s[0], 0.25f * s[1]);
      }
    }
  }
};

// One warp's 16 x 16 tile times the DFT-16: rows of A (real and imaginary parts), C in float32 (n-tiles 0 and 1);
// the inverse multiplies by the conjugate.
template <bool kInverse>
__device__ __forceinline__ void dft_tile(const uint32_t (&ar)[4], const uint32_t (&ai)[4], const Dft16& w,
                                         float (&cr)[2][4], float (&ci)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) cr[nt][e] = ci[nt][e] = 0.f;
    mma16816(cr[nt], ar, w.re[nt]);
    mma16816(cr[nt], ai, kInverse ? w.im[nt] : w.neg_im[nt]);
    mma16816(ci[nt], ar, kInverse ? w.neg_im[nt] : w.im[nt]);
    mma16816(ci[nt], ai, w.re[nt]);
  }
}

// The (row, column) of C element e of n-tile nt that this lane holds
__device__ __forceinline__ int c_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int c_col(int lane, int nt, int e) { return (lane & 3) * 2 + (e & 1) + 8 * nt; }

template <typename Twiddle>
__device__ __forceinline__ void twiddle_tile(float (&cr)[2][4], float (&ci)[2][4], int lane, Twiddle&& tw) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 z = cmul(make_float2(cr[nt][e], ci[nt][e]), tw(c_row(lane, e), c_col(lane, nt, e)));
      cr[nt][e] = z.x;
      ci[nt][e] = z.y;
    }
  }
}

// C as four float16 pairs: (n-tile 0, rows g), (0, g + 8), (1, g), (1, g + 8) — the stmatrix registers, and
// also the A fragment of the same 16 x 16 values with k = column.
__device__ __forceinline__ void pack_tile(const float (&c)[2][4], uint32_t (&r)[4]) {
  r[0] = pack_half2(c[0][0], c[0][1]);
  r[1] = pack_half2(c[0][2], c[0][3]);
  r[2] = pack_half2(c[1][0], c[1][1]);
  r[3] = pack_half2(c[1][2], c[1][3]);
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

  // the fragment-order slot of the spectrum's position p: the fused pass's tile, row, column
  static __device__ int slot(int p) {
    const int tile = p >> 8, row = (p >> 4) & 15, col = p & 15;
    const int lane = (row & 7) * 4 + ((col & 7) >> 1);
    const int v = (col >> 3) * 4 + (row >> 3) * 2 + (col & 1);
    return ((tile * 2 + (v >> 2)) * 32 + lane) * 4 + (v & 3);
  }
  // the position the forward passes leave frequency f at: f = q0 + r (d1 + 16 d2 [+ 256 d3])
  static __device__ int position(int f) {
    const int q0 = f % kR, rest = f / kR;
    if (kA == 3) return q0 * kS0 + (rest & 15) * 256 + ((rest >> 4) & 15) * 16 + (rest >> 8);
    return q0 * kS0 + (rest & 15) * 16 + (rest >> 4);
  }

  __device__ uint32_t strided_addr(const __half* plane, int n, int tile) const {
    const int s = n / 16, per_block = s / 16;
    const int b = tile / per_block, j1 = tile % per_block;
    const int m = lane >> 3, i = lane & 7;
    return smem_addr(plane + swz(b * n + 16 * j1 + 8 * (m & 1) + (i + 8 * (m >> 1)) * s));
  }
  __device__ uint32_t group_addr(const __half* plane, int tile) const {
    const int m = lane >> 3, i = lane & 7;
    return smem_addr(plane + swz(16 * (16 * tile + i + 8 * (m & 1)) + 8 * (m >> 1)));
  }

  // the radix-16 pass over blocks of n points (stride n / 16), forward (its output twiddles) or inverse (the
  // next pass's input twiddles)
  template <bool kInverse>
  __device__ void strided_pass(int n, const Dft16& w) const {
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = strided_addr(re, n, tile), a_im = strided_addr(im, n, tile);
      uint32_t ar[4], ai[4];
      ldsm_x4(a_re, ar, true);
      ldsm_x4(a_im, ai, true);
      float cr[2][4], ci[2][4];
      dft_tile<kInverse>(ar, ai, w, cr, ci);
      if (!kInverse && n == 4096) {
        const int j1 = tile & 15;
        twiddle_tile(cr, ci, lane, [&](int row, int col) { return cmul(w4096[row * col], w256[(j1 * col) & 255]); });
      } else if (!kInverse) {
        twiddle_tile(cr, ci, lane, [&](int row, int col) { return w256[row * col]; });
      } else if (n == 256 && kA == 3) {
        const int qb = tile & 15;
        twiddle_tile(cr, ci, lane,
                     [&](int row, int col) { return conj2(cmul(w4096[row * qb], w256[(col * qb) & 255])); });
      }
      uint32_t r[4];
      pack_tile(cr, r);
      stsm_x4(a_re, r, true);
      pack_tile(ci, r);
      stsm_x4(a_im, r, true);
    }
  }

  // the last forward pass, the product with the spectrum and the first inverse pass, per group of 16 points
  __device__ void fused_pass(const Dft16& w) const {
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = group_addr(re, tile), a_im = group_addr(im, tile);
      uint32_t ar[4], ai[4];
      ldsm_x4(a_re, ar, false);
      ldsm_x4(a_im, ai, false);
      float cr[2][4], ci[2][4];
      dft_tile<false>(ar, ai, w, cr, ci);
      const uint4 k0 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2) * 32 + lane];
      const uint4 k1 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2 + 1) * 32 + lane];
      const uint32_t kv[2][4] = {{k0.x, k0.y, k0.z, k0.w}, {k1.x, k1.y, k1.z, k1.w}};
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const float2 z = cmul(make_float2(cr[nt][e], ci[nt][e]), unpack_half2(kv[nt][e]));
          cr[nt][e] = z.x;
          ci[nt][e] = z.y;
        }
      }
      pack_tile(cr, ar);
      pack_tile(ci, ai);
      dft_tile<true>(ar, ai, w, cr, ci);
      twiddle_tile(cr, ci, lane, [&](int row, int col) { return conj2(w256[row * col]); });
      uint32_t r[4];
      pack_tile(cr, r);
      stsm_x4(a_re, r, false);
      pack_tile(ci, r);
      stsm_x4(a_im, r, false);
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

__device__ __forceinline__ float gated(const __nv_bfloat16* u, const __nv_bfloat16* gate, int64_t at) {
  const float v = __bfloat162float(u[at]);
  return gate ? v * __bfloat162float(gate[at]) : v;
}

template <int N>
__global__ void __launch_bounds__(kThreads, 1) tc_forward_kernel(const TcParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = TcShape<N>;
  using Block = TcBlock<N>;
  constexpr int kR = Shape::kR, kS0 = Shape::kS0, kM = N / 2;
  constexpr int kLive = kR > 1 ? kR / 2 : 1;  // L <= N / 2: the upper half of the CUDA-core pass's inputs is zero
  const float norm = rsqrtf((float)kR);
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

  // twiddle tables and the head's spectrum, scaled into float16, in the fused pass's fragment order
  {
    const int t = threadIdx.x & 255;
    float s, c;
    sincospif((float)t / (threadIdx.x < 256 ? 128.f : 2048.f), &s, &c);
    (threadIdx.x < 256 ? w256 : w4096)[t] = make_float2(c, -s);
  }
  const float2* S = p.S + (int64_t)h * (kM + 1);
  float m = 0.f;
  for (int f = threadIdx.x; f <= kM; f += kThreads) {
    const float2 v = S[f];
    m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) block_scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, block_scratch[i]);
  const float sk = unit_scale(m);
  for (int f = threadIdx.x; f <= kM; f += kThreads) {
    const float2 v = S[f];
    blk.spectrum[Block::slot(Block::position(f))] = pack_half2(v.x * sk, v.y * sk);
    if (f > 0 && f < kM) blk.spectrum[Block::slot(Block::position(N - f))] = pack_half2(v.x * sk, -v.y * sk);
  }
  __syncthreads();

  const Dft16 dft(blk.lane);
  const float D = p.D ? p.D[h] : 0.f;
  const int L = p.L;
  for (int pair = first + pipe; pair < last; pair += kPipes) {
    const int b1 = 2 * pair;
    const bool two = b1 + 1 < p.B;
    const int64_t row1 = ((int64_t)b1 * p.H + h) * L;
    const int64_t row2 = ((int64_t)(b1 + 1) * p.H + h) * L;
    // each row's scale
    float2 mx = make_float2(0.f, 0.f);
    for (int i = blk.tid; i < L; i += kPipeThreads) {
      mx.x = fmaxf(mx.x, fabsf(gated(p.u, p.pregate, row1 + i)));
      if (two) mx.y = fmaxf(mx.y, fabsf(gated(p.u, p.pregate, row2 + i)));
    }
    mx = blk.pipe_max(mx, pipe);
    const float s1 = unit_scale(mx.x), s2 = unit_scale(mx.y);
    // the radix-r pass (decimation in frequency) from the rows
    for (int j = blk.tid; j < kS0; j += kPipeThreads) {
      float2 x[kLive];
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        const int at = j + t * kS0;
        x[t].x = at < L ? gated(p.u, p.pregate, row1 + at) * s1 : 0.f;
        x[t].y = two && at < L ? gated(p.u, p.pregate, row2 + at) * s2 : 0.f;
      }
      float2 w1 = make_float2(1.f, 0.f);
      if (kR > 1) {
        float s, c;
        __sincosf(-6.283185307179586f * (float)j / (float)N, &s, &c);
        w1 = make_float2(c, s);
      }
      float2 wq = make_float2(norm, 0.f);
#pragma unroll
      for (int q = 0; q < kR; ++q) {
        float2 y = x[0];
#pragma unroll
        for (int t = 1; t < kLive; ++t) y = cadd(y, cmul(x[t], w8(t * q * (8 / kR))));
        y = cmul(y, wq);
        wq = cmul(wq, w1);
        const int at = swz(j + q * kS0);
        blk.re[at] = __float2half_rn(y.x);
        blk.im[at] = __float2half_rn(y.y);
      }
    }
    pipe_sync(pipe);
    if (Shape::kA == 3) {
      blk.template strided_pass<false>(4096, dft);
      pipe_sync(pipe);
    }
    blk.template strided_pass<false>(256, dft);
    pipe_sync(pipe);
    blk.fused_pass(dft);
    pipe_sync(pipe);
    blk.template strided_pass<true>(256, dft);
    pipe_sync(pipe);
    if (Shape::kA == 3) {
      blk.template strided_pass<true>(4096, dft);
      pipe_sync(pipe);
    }
    // the inverse radix-r pass (decimation in time) and the epilogue
    const float un1 = 1.f / (s1 * sk), un2 = 1.f / (s2 * sk);
    for (int j = blk.tid; j < kS0; j += kPipeThreads) {
      float2 x[kR];
      float2 w1 = make_float2(1.f, 0.f);
      if (kR > 1) {
        float s, c;
        __sincosf(6.283185307179586f * (float)j / (float)N, &s, &c);
        w1 = make_float2(c, s);
      }
      float2 wq = make_float2(norm, 0.f);
#pragma unroll
      for (int q = 0; q < kR; ++q) {
        const int at = swz(j + q * kS0);
        x[q] = cmul(make_float2(__half2float(blk.re[at]), __half2float(blk.im[at])), wq);
        wq = cmul(wq, w1);
      }
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        const int at = j + t * kS0;
        if (at >= L) break;
        float2 y = x[0];
#pragma unroll
        for (int q = 1; q < kR; ++q) y = cadd(y, cmul(x[q], w8(-t * q * (8 / kR))));
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !two) break;
          const int64_t o = (r == 0 ? row1 : row2) + at;
          const float v = gated(p.u, p.pregate, o);
          float c = (r == 0 ? y.x * un1 : y.y * un2) + D * v;
          if (p.gelu) c = gelu_f(c);
          if (p.postgate) c *= __bfloat162float(p.postgate[o]);
          p.y[o] = __float2bfloat16_rn(c);
        }
      }
    }
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
  const TcParams p{static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate),
                   static_cast<const __nv_bfloat16*>(a.postgate), a.S, a.D, static_cast<__nv_bfloat16*>(a.y),
                   a.B, a.H, a.L, chunks, a.gelu};
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
