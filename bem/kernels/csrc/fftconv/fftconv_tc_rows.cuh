// The tensor-core fftconv kernels' CUDA-core passes (fftconv_tc.cu, fftconv_tc_filter_grad.cu): the radix-r pass
// that reads the rows (with the pre-gate, 16-byte loads where aligned) into the float16 planes, its inverse with
// the epilogue (GELU, the post-gate) into y, the filter gradient's real inverse into a row, and dD's dot product.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>

#include "fftconv_block.cuh"
#include "fftconv_tc_plan.cuh"

namespace bem {
namespace fftconv {
namespace tc {

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
__device__ __forceinline__ void load_gated(const TcParams& p, int64_t row, int at, float (&v)[V]) {
  load_row<V>(p.u, row, at, p.L, p.vec, v);
  if (p.pregate) {
    float g[V];
    load_row<V>(p.pregate, row, at, p.L, p.vec, g);
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

  // kV == 1 (N = 2048: one point a thread per stride): the rows move between global memory and the threads through
  // the pipeline's planes, reused as float32 rows of N / 2, so that global memory sees 16-byte accesses of 8
  // consecutive values (2-byte loads and stores of one value each had doubled the kernel's time with gates).
  static constexpr bool kStaged = kV == 1;
  static_assert(!kStaged || (kLive * kS0 == N / 2 && N / 2 * 2 == 8 * kPipeThreads), "the staged rows' split");
  static __device__ int staged_row(int tid) { return tid / (kPipeThreads / 2); }
  static __device__ int staged_at(int tid) { return (tid % (kPipeThreads / 2)) * 8; }
  static __device__ float* staged(__half* re) { return reinterpret_cast<float*>(re); }  // re and im: N floats

  // W_N^{±j}
  static __device__ float2 root(int j, bool inverse) {
    float s, c;
    __sincosf((inverse ? 6.283185307179586f : -6.283185307179586f) * (float)j / (float)N, &s, &c);
    return make_float2(c, s);
  }

  // the rows' values at this thread's points of one chunk (zero for an absent second row), and their maxima
  static __device__ void load_chunk(const TcParams& p, int64_t row1, int64_t row2, bool two, int tid, int chunk,
                                    float (&a)[kLive][kV], float (&b)[kLive][kV], float2& m) {
#pragma unroll
    for (int t = 0; t < kLive; ++t) {
      const int at = first_j(tid, chunk) + t * kS0;
      load_gated<kV>(p, row1, at, a[t]);
      if (two) load_gated<kV>(p, row2, at, b[t]);
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

  // the rows' values into the staged rows (zero past L and for an absent second row); the caller syncs the pipeline
  static __device__ void stage_rows(const TcParams& p, int64_t row1, int64_t row2, bool two, __half* re, int tid) {
    const int r = staged_row(tid), at = staged_at(tid);
    float v[8];
    if (r == 0 || two) {
      load_gated<8>(p, r == 0 ? row1 : row2, at, v);
    } else {
#pragma unroll
      for (int e = 0; e < 8; ++e) v[e] = 0.f;
    }
    float4* out = reinterpret_cast<float4*>(staged(re) + r * (N / 2) + at);
    out[0] = make_float4(v[0], v[1], v[2], v[3]);
    out[1] = make_float4(v[4], v[5], v[6], v[7]);
  }

  // The radix-r pass from the rows. Each row's largest |v|, through `reduce` (the pipeline's maxima), gives its
  // scale s; with kSharedScale the pair's largest gives one scale for both (their parts are summed afterwards).
  // The rows' values stay in registers between the maxima and the pass where they fit (up to 16 a row and
  // thread), else they are loaded again (from L1 or L2).
  // With kLooped (and rows not held), one chunk's code runs in a loop: the filter gradient's kernel, which inlines
  // this pass twice, outgrew the instruction cache with it unrolled (at N = 16384, 10,336 instructions against
  // 7,400; no-instruction stalls were a fifth of its samples). The forward kernel keeps it unrolled, 3% faster.
  template <bool kSharedScale = false, bool kLooped = false, typename Reduce>
  static __device__ void forward(const TcParams& p, int64_t row1, int64_t row2, bool two, __half* re, __half* im,
                                 int tid, Reduce&& reduce, float& s1, float& s2) {
    constexpr bool kHold = kChunks * kLive * kV <= 16;
    constexpr int kUnroll = kLooped && !kHold ? 1 : kChunks;  // held values are indexed by chunk: unrolled
    float a[kHold ? kChunks : 1][kLive][kV], b[kHold ? kChunks : 1][kLive][kV];
    float2 m = make_float2(0.f, 0.f);
    if constexpr (kStaged) {  // every thread reads its values before `reduce`'s barrier, the pass writes after it
      stage_rows(p, row1, row2, two, re, tid);
      pipe_sync(threadIdx.x / kPipeThreads);
      const float* rows = staged(re);
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        a[0][t][0] = rows[tid + t * kS0];
        b[0][t][0] = rows[N / 2 + tid + t * kS0];
        m.x = fmaxf(m.x, fabsf(a[0][t][0]));
        m.y = fmaxf(m.y, fabsf(b[0][t][0]));
      }
    } else {
#pragma unroll kUnroll
      for (int chunk = 0; chunk < kChunks; ++chunk)
        load_chunk(p, row1, row2, two, tid, chunk, a[kHold ? chunk : 0], b[kHold ? chunk : 0], m);
    }
    const float2 mx = reduce(m);
    s1 = unit_scale(kSharedScale ? fmaxf(mx.x, mx.y) : mx.x);
    s2 = unit_scale(kSharedScale ? fmaxf(mx.x, mx.y) : mx.y);
#pragma unroll kUnroll
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      if (!kHold) load_chunk(p, row1, row2, two, tid, chunk, a[0], b[0], m);
      transform_chunk(a[kHold ? chunk : 0], b[kHold ? chunk : 0], s1, s2, first_j(tid, chunk), re, im);
    }
  }

  // one chunk of the inverse: x_q = W_N^{-jq} z_q, y_t = r^-1/2 sum_q x_q W_r^{-tq}, times un1 (real parts) and
  // un2 (imaginary parts)
  static __device__ void inverse_chunk(int j0, float un1, float un2, const __half* re, const __half* im,
                                       float (&o1)[kLive][kV], float (&o2)[kLive][kV]) {
    const float norm = rsqrtf((float)kR);
    __half zr[kR][kV], zi[kR][kV];
#pragma unroll
    for (int q = 0; q < kR; ++q) {
      const int at = swz(j0 + q * kS0);
      copy_halves<kV>(zr[q], re + at);
      copy_halves<kV>(zi[q], im + at);
    }
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
  }

  // the epilogue (GELU, the post-gate) on V consecutive outputs of one row, into y
  template <int V>
  static __device__ void epilogue(const TcParams& p, int64_t row, int at, const float (&c)[V]) {
    float post[V], y[V];
    if (p.postgate) load_row<V>(p.postgate, row, at, p.L, p.vec, post);
#pragma unroll
    for (int e = 0; e < V; ++e) {
      const float x = p.gelu ? gelu_f(c[e]) : c[e];
      y[e] = p.postgate ? x * post[e] : x;
    }
    store_row<V>(p.y, row, at, p.L, p.vec, y);
  }

  // the inverse and the epilogue on both rows (D v came through the transforms: the spectrum is S + D)
  static __device__ void inverse(const TcParams& p, int64_t row1, int64_t row2, bool two, float un1, float un2,
                                 __half* re, const __half* im, int tid) {
    if constexpr (kStaged) {  // the outputs through the staged rows, once every thread has read the planes
      float o1[kLive][kV], o2[kLive][kV];
      inverse_chunk(first_j(tid, 0), un1, un2, re, im, o1, o2);
      const int pipe = threadIdx.x / kPipeThreads;
      pipe_sync(pipe);
      float* rows = staged(re);
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        rows[tid + t * kS0] = o1[t][0];
        rows[N / 2 + tid + t * kS0] = o2[t][0];
      }
      pipe_sync(pipe);
      const int r = staged_row(tid), at = staged_at(tid);
      if (at < p.L && (r == 0 || two)) {
        const float4* in = reinterpret_cast<const float4*>(rows + r * (N / 2) + at);
        const float4 c0 = in[0], c1 = in[1];
        float c[8] = {c0.x, c0.y, c0.z, c0.w, c1.x, c1.y, c1.z, c1.w};
        epilogue<8>(p, r == 0 ? row1 : row2, at, c);
      }
    } else {
#pragma unroll 1
      for (int chunk = 0; chunk < kChunks; ++chunk) {
        const int j0 = first_j(tid, chunk);
        float o1[kLive][kV], o2[kLive][kV];
        inverse_chunk(j0, un1, un2, re, im, o1, o2);
#pragma unroll
        for (int t = 0; t < kLive; ++t) {
          const int at = j0 + t * kS0;
          if (at >= p.L) break;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            if (r == 1 && !two) break;
            epilogue<kV>(p, r == 0 ? row1 : row2, at, r == 0 ? o1[t] : o2[t]);
          }
        }
      }
    }
  }

  // the inverse's real parts times `un` at positions below `taps`, into a float32 row (the filter gradient's share;
  // shared memory), or added to it with `accumulate` (each thread reads back only what it wrote)
  static __device__ void inverse_real(float* out, int taps, float un, bool accumulate, const __half* re,
                                      const __half* im, int tid) {
#pragma unroll 1
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      const int j0 = first_j(tid, chunk);
      float o1[kLive][kV], o2[kLive][kV];
      inverse_chunk(j0, un, 0.f, re, im, o1, o2);
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        const int at = j0 + t * kS0;
#pragma unroll
        for (int e = 0; e < kV; ++e)
          if (at + e < taps) out[at + e] = accumulate ? out[at + e] + o1[t][e] : o1[t][e];
      }
    }
  }

  // this thread's share of sum_t g_t v_t over the pair's rows (g and v each with its gate), in float32. Without
  // gates and with 16-byte rows, every load of a chunk is issued before the products (a load a point in order, with
  // its branches, left each warp waiting on one load at a time).
  static __device__ float dot(const TcParams& g, const TcParams& v, int64_t row1, int64_t row2, bool two, int tid) {
    float acc = 0.f;
    const bool direct = kV == 8 && g.vec && v.vec && g.pregate == nullptr && v.pregate == nullptr;
#pragma unroll 1
    for (int chunk = 0; chunk < kChunks; ++chunk) {
      if (direct) {
        uint4 gw[kLive][2], vw[kLive][2];
#pragma unroll
        for (int t = 0; t < kLive; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            const int at = first_j(tid, chunk) + t * kS0;
            const bool in = at < g.L && (r == 0 || two);  // L a multiple of 8: the whole vector is inside
            const int64_t row = r == 0 ? row1 : row2;
            const uint4 zero = make_uint4(0, 0, 0, 0);
            gw[t][r] = in ? *reinterpret_cast<const uint4*>(g.u + row + at) : zero;
            vw[t][r] = in ? *reinterpret_cast<const uint4*>(v.u + row + at) : zero;
          }
#pragma unroll
        for (int t = 0; t < kLive; ++t)
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            float a[8], b[8];
            unpack_bf16x8(gw[t][r], a);
            unpack_bf16x8(vw[t][r], b);
#pragma unroll
            for (int e = 0; e < 8; ++e) acc = fmaf(a[e], b[e], acc);
          }
        continue;
      }
#pragma unroll
      for (int t = 0; t < kLive; ++t) {
        const int at = first_j(tid, chunk) + t * kS0;
        if (at >= g.L) break;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          if (r == 1 && !two) break;
          float a[kV], b[kV];
          load_gated<kV>(g, r == 0 ? row1 : row2, at, a);
          load_gated<kV>(v, r == 0 ? row1 : row2, at, b);
#pragma unroll
          for (int e = 0; e < kV; ++e) acc = fmaf(a[e], b[e], acc);
        }
      }
    }
    return acc;
  }
};

}  // namespace tc
}  // namespace fftconv
}  // namespace bem
