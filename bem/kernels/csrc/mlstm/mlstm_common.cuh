// Device helpers of the mLSTM kernels: 64 x 64 tiles staged in shared memory, a warp-level tile product
// on the tensor cores (ldmatrix + mma.sync m16n8k16, fp32 accumulation; sm_80+) with a plain FMA
// fallback of the same register layout (float32 inputs, older GPUs), and the chunk's gates.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cstdint>
#include <type_traits>

#include "mlstm_launchers.h"

namespace bem {
namespace mlstm {

constexpr int L = kMlstmChunk;  // tokens per chunk, and the rows of every staged tile
constexpr int kThreads = 128;   // 4 warps of 16 rows each
constexpr float kNegInf = -__builtin_huge_valf();

// Row stride of a 64-column shared tile: padded by 16 bytes so that ldmatrix's 8 rows hit 8 bank groups.
template <typename T> struct Tile { static constexpr int stride = 64 + 16 / (int)sizeof(T); };
template <typename T> __host__ __device__ constexpr int tile_elems() { return L * Tile<T>::stride; }

__device__ __forceinline__ float to_f(float v) { return v; }
__device__ __forceinline__ float to_f(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_f(__nv_bfloat16 v) { return __bfloat162float(v); }
template <typename T> __device__ __forceinline__ T from_f(float v);
template <> __device__ __forceinline__ float from_f<float>(float v) { return v; }
template <> __device__ __forceinline__ __half from_f<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_f<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }

// An operand of a tile product, in T. float16 saturates at its largest finite value instead of becoming inf:
// an inf operand turns the product's sums of opposite signs into inf - inf = NaN, where the saturated one
// keeps them finite (the outputs, rounded with from_f, still become inf where they exceed float16).
// NaN stays NaN.
template <typename T> __device__ __forceinline__ T tile_f(float v) { return from_f<T>(v); }
template <> __device__ __forceinline__ __half tile_f<__half>(float v) {
  constexpr float kMax = 65504.f;
  return __float2half_rn(fabsf(v) > kMax ? copysignf(kMax, v) : v);
}

// Two adjacent elements (x at `at`, y after it) as one 4- or 8-byte store: `at` an even element of a row.
template <typename T> __device__ __forceinline__ void store2(T* at, T x, T y) {
  if constexpr (sizeof(T) == 2) {
    const T pair[2] = {x, y};
    uint32_t packed;
    memcpy(&packed, pair, sizeof(packed));
    *reinterpret_cast<uint32_t*>(at) = packed;
  } else {
    *reinterpret_cast<float2*>(at) = make_float2(x, y);
  }
}

template <typename T> __device__ __forceinline__ float load_gate(const void* p, bool fp32, int64_t index) {
  return fp32 ? static_cast<const float*>(p)[index] : to_f(static_cast<const T*>(p)[index]);
}

// exp and division for the weights of inputs of type T. The extension is built with --use_fast_math, which
// makes float32's expf the approximate __expf (its error in the exponent, |x| 2^-24, is above float32's own
// rounding) and its division approximate: the float32 instantiations take exp through double and round
// their divisions, so that they keep float32's accuracy. 16-bit inputs keep the fast forms, far below
// their own precision.
// The type of the chunk's scanned gates (g, a, pm below) and of the log weights formed from them: double for
// float32 inputs, float for 16-bit ones.
template <typename T> using GateT = typename std::conditional<std::is_same<T, float>::value, double, float>::type;

__device__ __forceinline__ float gmax(float x, float y) { return fmaxf(x, y); }
__device__ __forceinline__ double gmax(double x, double y) { return fmax(x, y); }

template <typename T> __device__ __forceinline__ float wexp(GateT<T> x) {
  if constexpr (std::is_same<T, float>::value) {
    return static_cast<float>(exp(x));
  } else {
    return __expf(x);
  }
}
template <typename T> __device__ __forceinline__ float wdiv(float a, float b) {
  if constexpr (std::is_same<T, float>::value) {
    return __fdiv_rn(a, b);
  } else {
    return a / b;
  }
}

// log σ(x) = min(x, 0) - log1p(exp(-|x|)): finite for every finite x.
template <typename T> __device__ __forceinline__ float log_sigmoid(float x) {
  if constexpr (std::is_same<T, float>::value) {
    return static_cast<float>(fmin(static_cast<double>(x), 0.0) - log1p(exp(-fabs(static_cast<double>(x)))));
  } else {
    return fminf(x, 0.f) - log1pf(__expf(-fabsf(x)));
  }
}

__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(valid ? 16 : 0));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending) : "memory");
}
__device__ __forceinline__ void cp_async_wait_all() {
  cp_async_commit();
  cp_async_wait<0>();
}

// tile[r * Stride + c] = src[(r0 + r) * ld + c0 + c] for r < 64, c < Cols, zero where r0 + r >= rows or
// c0 + c >= cols. vec: 16-byte copies (cp.async; src of type T, ld and cols multiples of 16 bytes, src 16-byte
// aligned).
template <int Cols, int Stride, typename T, typename Src>
__device__ __forceinline__ void stage_rows(T* tile, const Src* src, int64_t ld, int r0, int rows, int c0, int cols,
                                           bool vec) {
  if constexpr (std::is_same<T, Src>::value) {
    if (vec) {
      constexpr int kVec = 16 / (int)sizeof(T);
      constexpr int kChunks = Cols / kVec;
      for (int idx = threadIdx.x; idx < L * kChunks; idx += kThreads) {
        const int r = idx / kChunks, c = (idx % kChunks) * kVec;
        const bool ok = r0 + r < rows && c0 + c < cols;
        cp_async16(tile + r * Stride + c, ok ? src + (int64_t)(r0 + r) * ld + c0 + c : src, ok);
      }
      return;
    }
  }
  for (int idx = threadIdx.x; idx < L * Cols; idx += kThreads) {
    const int r = idx / Cols, c = idx % Cols;
    const bool ok = r0 + r < rows && c0 + c < cols;
    tile[r * Stride + c] = tile_f<T>(ok ? to_f(src[(int64_t)(r0 + r) * ld + c0 + c]) : 0.f);
  }
}

// A 64 x 64 tile (stride Tile<T>::stride) of src, as stage_rows.
template <typename T, typename Src>
__device__ __forceinline__ void stage_tile(T* tile, const Src* src, int64_t ld, int r0, int rows, int c0, int cols,
                                           bool vec) {
  stage_rows<64, Tile<T>::stride>(tile, src, ld, r0, rows, c0, cols, vec);
}

#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
#define BEM_MLSTM_MMA 1
#endif

__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const void* p, bool trans) {
  const unsigned a = static_cast<unsigned>(__cvta_generic_to_shared(p));
  if (trans) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  } else {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(a));
  }
}

template <typename T>
__device__ __forceinline__ void mma16816(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1) {
#ifdef BEM_MLSTM_MMA
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
#endif
}

// acc (16 x 64, rows m0.. of A) += A (16 x 64) B (64 x 64), both from shared tiles (stride Tile<T>::stride):
//   A stored row-major A[m][k] (ATrans false) or as its transpose At[k][m] (ATrans true);
//   B stored as Bn[n][k] (BTrans false) or Bk[k][n] (BTrans true).
// Accumulator layout (mma.sync m16n8): acc[nt][e] is row m0 + lane / 4 + 8 (e / 2), column 8 nt + 2 (lane % 4) + e % 2.
template <typename T, bool ATrans, bool BTrans>
__device__ __forceinline__ void warp_mma(float (&acc)[8][4], const T* A, int m0, const T* B) {
  constexpr int S = Tile<T>::stride;
  const int lane = threadIdx.x % 32;
#ifdef BEM_MLSTM_MMA
  if constexpr (sizeof(T) == 2) {
    const int j = lane / 8, r = lane % 8;
#pragma unroll
    for (int k0 = 0; k0 < 64; k0 += 16) {
      uint32_t a[4];
      if (ATrans) {
        ldsm_x4(a, A + (k0 + r + (j / 2) * 8) * S + m0 + (j % 2) * 8, true);
      } else {
        ldsm_x4(a, A + (m0 + lane % 16) * S + k0 + (lane / 16) * 8, false);
      }
#pragma unroll
      for (int nt = 0; nt < 8; nt += 2) {
        uint32_t b[4];
        if (BTrans) {
          ldsm_x4(b, B + (k0 + r + (j % 2) * 8) * S + nt * 8 + (j / 2) * 8, true);
        } else {
          ldsm_x4(b, B + (nt * 8 + r + (j / 2) * 8) * S + k0 + (j % 2) * 8, false);
        }
        mma16816<T>(acc[nt], a, b[0], b[1]);
        mma16816<T>(acc[nt + 1], a, b[2], b[3]);
      }
    }
    return;
  }
#endif
  const int g = lane / 4, c = lane % 4;
#pragma unroll 4
  for (int k = 0; k < 64; ++k) {
    const float a_lo = to_f(ATrans ? A[k * S + m0 + g] : A[(m0 + g) * S + k]);
    const float a_hi = to_f(ATrans ? A[k * S + m0 + g + 8] : A[(m0 + g + 8) * S + k]);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt) {
      const int n = nt * 8 + 2 * c;
      const float b0 = to_f(BTrans ? B[k * S + n] : B[n * S + k]);
      const float b1 = to_f(BTrans ? B[k * S + n + 1] : B[(n + 1) * S + k]);
      acc[nt][0] += a_lo * b0;
      acc[nt][1] += a_lo * b1;
      acc[nt][2] += a_hi * b0;
      acc[nt][3] += a_hi * b1;
    }
  }
}

__device__ __forceinline__ void zero(float (&acc)[8][4]) {
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[nt][e] = 0.f;
}

// Row and column (within the 16 x 64 warp tile) of accumulator element (nt, e).
__device__ __forceinline__ int acc_row(int e) { return (threadIdx.x % 32) / 4 + 8 * (e / 2); }
__device__ __forceinline__ int acc_col(int nt, int e) { return nt * 8 + 2 * (threadIdx.x % 4) + (e % 2); }

// The gates of chunk c as warp 0 holds them: tokens 2 lane and 2 lane + 1, the raw pre-activations f̃ (+inf
// beyond the last token, where log σ is 0) and ĩ (-inf beyond it). Raw, so that a kernel walking the chunks
// in sequence can load the next chunk's while it works on this one without waiting for them: log σ is taken
// in scan_gates.
struct ChunkGates {
  float f0, f1, i0, i1;
};

template <typename T>
__device__ __forceinline__ ChunkGates load_chunk_gates(const MlstmShape& sh, const void* igate, const void* fgate,
                                                       int bh, int c) {
  const int lane = threadIdx.x % 32;
  const int t0 = c * L + 2 * lane, t1 = t0 + 1;
  const int64_t base = (int64_t)bh * sh.S;
  constexpr float kInf = __builtin_huge_valf();
  ChunkGates r;
  r.f0 = t0 < sh.S ? load_gate<T>(fgate, sh.gates_fp32, base + t0) : kInf;
  r.f1 = t1 < sh.S ? load_gate<T>(fgate, sh.gates_fp32, base + t1) : kInf;
  r.i0 = t0 < sh.S ? load_gate<T>(igate, sh.gates_fp32, base + t0) : kNegInf;
  r.i1 = t1 < sh.S ? load_gate<T>(igate, sh.gates_fp32, base + t1) : kNegInf;
  return r;
}

// The chunk's gates, scanned by one warp (scan_gates, in its registers; scan_chunk_gates and chunk_gates,
// into shared memory by warp 0 only, the caller synchronising):
//   g[t]  inclusive cumulative log σ(f̃) within the chunk,
//   a[t]  = ĩ_t - g[t] (-inf beyond the last token): key t's log weight relative to the chunk's start,
//   pm[t] = max over s <= t of a[s]: with M_t = max(m_c, pm[t]) the stabiliser of query t is g[t] + M_t.
// The same arithmetic in the same order in every kernel, so forward and backward agree to the bit.
// float32 inputs scan in double and keep g, a and pm in double (GateT), and the kernels form every log weight
// (a_s - M_t, m_c - M_t, G + a_s - m_{c+1}) from them in double: a and M reach tens to hundreds within a
// chunk, so a float32 rounding of either costs an ulp of that, a few 1e-6, in the weight exp(a_s - M_t) of
// every key, the query's own included; where a token's denominator cancels (|den| far below the sum of its
// terms) that alone made h err 3x the PyTorch formulation (GPU, S 100, initial state; reproduced bit for
// bit in scripts/mlstm_float32_emulation.py). 16-bit inputs keep all of it in float, far below their own
// rounding.
template <typename T> struct ScannedGates {
  GateT<T> g0, g1, a0, a1, pm0, pm1;  // tokens 2 lane and 2 lane + 1
};

template <typename T> __device__ __forceinline__ ScannedGates<T> scan_gates(const ChunkGates& r) {
  using Acc = GateT<T>;
  const int lane = threadIdx.x % 32;
  const float lf0 = log_sigmoid<T>(r.f0), lf1 = log_sigmoid<T>(r.f1);
  const Acc pair = static_cast<Acc>(lf0) + static_cast<Acc>(lf1);
  Acc incl = pair;
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Acc y = __shfl_up_sync(0xffffffffu, incl, o);
    if (lane >= o) incl += y;
  }
  Acc before_sum = __shfl_up_sync(0xffffffffu, incl, 1);
  if (lane == 0) before_sum = 0;
  ScannedGates<T> s;
  s.g0 = before_sum + static_cast<Acc>(lf0);
  s.g1 = incl;
  s.a0 = static_cast<Acc>(r.i0) - s.g0;
  s.a1 = static_cast<Acc>(r.i1) - s.g1;
  Acc run = gmax(s.a0, s.a1);
#pragma unroll
  for (int o = 1; o < 32; o <<= 1) {
    const Acc y = __shfl_up_sync(0xffffffffu, run, o);
    if (lane >= o) run = gmax(run, y);
  }
  Acc before = __shfl_up_sync(0xffffffffu, run, 1);
  if (lane == 0) before = static_cast<Acc>(kNegInf);
  s.pm0 = gmax(before, s.a0);
  s.pm1 = run;
  return s;
}

template <typename T>
__device__ __forceinline__ void scan_chunk_gates(const ChunkGates& r, GateT<T>* g, GateT<T>* a, GateT<T>* pm) {
  const int lane = threadIdx.x % 32;
  const ScannedGates<T> s = scan_gates<T>(r);
  g[2 * lane] = s.g0;
  g[2 * lane + 1] = s.g1;
  a[2 * lane] = s.a0;
  a[2 * lane + 1] = s.a1;
  pm[2 * lane] = s.pm0;
  pm[2 * lane + 1] = s.pm1;
}

template <typename T>
__device__ __forceinline__ void chunk_gates(const MlstmShape& sh, const void* igate, const void* fgate, int bh, int c,
                                            GateT<T>* g, GateT<T>* a, GateT<T>* pm) {
  if (threadIdx.x >= 32) return;
  scan_chunk_gates<T>(load_chunk_gates<T>(sh, igate, fgate, bh, c), g, a, pm);
}

// launch(T{}) for the kernels' input dtype (a value of that type stands for it), or cudaErrorInvalidValue.
template <typename Launch> cudaError_t dispatch_dtype(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kBFloat16: return launch(__nv_bfloat16{});
    case DType::kHalf: return launch(__half{});
    case DType::kFloat: return launch(float{});
    default: return cudaErrorInvalidValue;
  }
}

// max(|den|, exp(-m)): the stabilised denominator of h.
template <typename T> __device__ __forceinline__ float normaliser(float den, float m) {
  return fmaxf(fabsf(den), wexp<T>(-m));
}

}  // namespace mlstm
}  // namespace bem
