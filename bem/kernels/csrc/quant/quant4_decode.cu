// The frozen 4-bit linear of bitsandbytes' layout (NF4 or FP4, with or without double quantization) and BEM's
// update in one kernel at decode sizes (M <= 16 tokens): each byte of W is read once, its two values are
// dequantized in registers through the 16-entry code, and the update s ((x V) ⊙ c) U^T and the bias are added
// as each output is written. bitsandbytes' own decode path dequantizes the whole weight to 16-bit (or runs its
// vector kernel at one token) and BEM's update would follow as launches of its own.
//
// A warp owns rows_per_warp rows of W over all of K; each lane takes eight values (four bytes) of each row per
// step, 256 values a warp step, so a row's bytes stream in 128-byte runs; the lane dequantizes its values of all
// the warp's rows first, then loads each token's eight values of x once for all of them. Sums stay in float32 and
// meet by shuffles.
#include "../common/common.cuh"
#include "quant4_layout.cuh"
#include "quant_launchers.h"

namespace bem {
namespace {

constexpr int kWarps = 8;
constexpr int kLaneValues = 8;                     // values of a row a lane takes per step (4 bytes)
constexpr int kWarpStep = 32 * kLaneValues;        // values of a row a warp takes per step

template <typename T, int MT, int ROWS>
__global__ void __launch_bounds__(kWarps * 32) quant4_decode_kernel(const Quant4DecodeArgs a) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = a.code[threadIdx.x];
  __syncthreads();
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int row0 = (blockIdx.x * kWarps + warp) * ROWS;
  if (row0 >= a.N) return;
  const T* x = static_cast<const T*>(a.x);
  const int K = a.K;

  float acc[ROWS][MT];
#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m) acc[i][m] = 0.f;

  for (int k = lane * kLaneValues; k < K; k += kWarpStep) {
    // the warp's rows first, dequantized in registers; then each token's eight values of x, loaded once, serve
    // every row (a row past N reads row N - 1 again and is never written)
    float w[ROWS][kLaneValues];
#pragma unroll
    for (int i = 0; i < ROWS; ++i) {
      const int n = min(row0 + i, a.N - 1);
      const int64_t e = (int64_t)n * K + k;  // the first of the lane's values in the flattened weight
      const uint32_t packed = __ldg(reinterpret_cast<const uint32_t*>(a.W + e / 2));
      const float s = block_absmax(a, e / a.blocksize);
#pragma unroll
      for (int b = 0; b < 4; ++b) {
        const uint32_t byte = (packed >> (8 * b)) & 0xffu;
        w[i][2 * b] = code[byte >> 4] * s;
        w[i][2 * b + 1] = code[byte & 0xfu] * s;
      }
    }
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (m >= a.M) break;
      float xv[kLaneValues];
      unpack8<T>(__ldg(reinterpret_cast<const uint4*>(x + (int64_t)m * K + k)), xv);
#pragma unroll
      for (int i = 0; i < ROWS; ++i) {
        float sum = acc[i][m];
#pragma unroll
        for (int v = 0; v < kLaneValues; ++v) sum = fmaf(w[i][v], xv[v], sum);
        acc[i][m] = sum;
      }
    }
  }

#pragma unroll
  for (int i = 0; i < ROWS; ++i)
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int offset = 16; offset > 0; offset /= 2) acc[i][m] += __shfl_xor_sync(0xffffffffu, acc[i][m], offset);

  // lane m writes token m's outputs of the warp's rows, with the bias and the update added in float32
  const T* bias = static_cast<const T*>(a.bias);
  const T* codes = static_cast<const T*>(a.codes);
  const T* U = static_cast<const T*>(a.U);
  T* Y = static_cast<T*>(a.Y);
#pragma unroll
  for (int i = 0; i < ROWS; ++i) {
    const int n = row0 + i;
#pragma unroll
    for (int m = 0; m < MT; ++m) {
      if (lane != m || m >= a.M || n >= a.N) continue;
      float update = 0.f;
      for (int j = 0; j < a.r; ++j) {
        const float c = codes ? to_acc(codes[(int64_t)m * a.r + j]) : 1.f;
        update = fmaf(a.P[(int64_t)m * a.r + j] * c, to_acc(U[(int64_t)n * a.r + j]), update);
      }
      float y = acc[i][m] + a.scale * update;
      if (bias) y += to_acc(bias[n]);
      Y[(int64_t)m * a.N + n] = from_acc<T>(y);
    }
  }
}

template <typename T, int MT>
cudaError_t launch_rows(const Quant4DecodeArgs& a, cudaStream_t stream) {
  const int rows = a.rows_per_warp;
  const int blocks = (a.N + kWarps * rows - 1) / (kWarps * rows);
  if (rows == 4) quant4_decode_kernel<T, MT, 4><<<blocks, kWarps * 32, 0, stream>>>(a);
  else if (rows == 2) quant4_decode_kernel<T, MT, 2><<<blocks, kWarps * 32, 0, stream>>>(a);
  else quant4_decode_kernel<T, MT, 1><<<blocks, kWarps * 32, 0, stream>>>(a);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_tokens(const Quant4DecodeArgs& a, cudaStream_t stream) {
  if (a.M <= 1) return launch_rows<T, 1>(a, stream);
  if (a.M <= 2) return launch_rows<T, 2>(a, stream);
  if (a.M <= 4) return launch_rows<T, 4>(a, stream);
  if (a.M <= 8) return launch_rows<T, 8>(a, stream);
  return launch_rows<T, 16>(a, stream);
}

}  // namespace

int quant4_rows_per_warp(int N, int num_sms) {
  for (int rows = 4; rows > 1; rows /= 2)
    if ((N + kWarps * rows - 1) / (kWarps * rows) >= 2 * num_sms) return rows;
  return 1;
}

cudaError_t launch_quant4_decode(DType dtype, const Quant4DecodeArgs& args, cudaStream_t stream) {
  if (args.M == 0 || args.N == 0) return cudaSuccess;
  if (args.M > kQuant4DecodeMaxTokens || args.K % 32 || args.blocksize % 32 || args.blocksize <= 0)
    return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kHalf: return launch_tokens<__half>(args, stream);
    case DType::kBFloat16: return launch_tokens<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
