// The tensor-core fftconv forward's plan (fftconv_tc.cu): its pipelines, the shape of N = r 16^a and the shared
// memory it takes, the planes' swizzle, the kernel's parameters, a pipeline's barrier and the rows' scale.
#pragma once

#include <cuda_bf16.h>

#include <cstdint>

namespace bem {
namespace fftconv {
namespace tc {

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

// one pipeline's barrier: named barrier 1 + pipe (0 is __syncthreads')
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
  bool vec;        // 16-byte accesses: L a multiple of 8 and every row pointer 16-byte aligned
  bool correlate;  // the spectrum conjugated: the correlation with the filter
};

// a power of two bringing m into (0.5, 1]; 1 for 0 (and for values that are not finite)
__device__ __forceinline__ float unit_scale(float m) {
  if (!(m > 0.f) || !isfinite(m)) return 1.f;
  int e;
  frexpf(m, &e);  // m = f 2^e, f in [0.5, 1)
  return ldexpf(1.f, -e);
}

}  // namespace tc
}  // namespace fftconv
}  // namespace bem
