// Shared device helpers for the BEM kernels: dtype conversion, 16-byte async copies, tile geometry.
// Kept free of torch headers so the kernels compile (and can be inspected) with nvcc alone.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <cstdint>

namespace bem {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_acc_d(double v);
template <> __device__ __forceinline__ double from_acc_d<double>(double v) { return v; }
template <> __device__ __forceinline__ float from_acc_d<float>(double v) { return static_cast<float>(v); }

// 16-byte global->shared copy that bypasses L1; with valid == false it writes 16 zero bytes
// (src-size 0), which is how out-of-range rows and columns of a tile become zeros.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Shared-memory rows are padded by 8 16-bit elements (16 bytes) to spread rows over the banks.
constexpr int kPad = 8;

__host__ __device__ constexpr int round_up(int v, int m) { return (v + m - 1) / m * m; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// 8 consecutive 16-bit values moved as one 16-byte word.
struct alignas(16) Vec8 { uint4 raw; };

template <typename T> __device__ __forceinline__ void unpack8(const uint4& raw, float out[8]) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_acc(v[i]);
}
template <typename T> __device__ __forceinline__ uint4 pack8(const float in[8]) {
  uint4 raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = from_acc<T>(in[i]);
  return raw;
}

}  // namespace bem
