// The small scaling steps between cuBLAS GEMMs, M x r values each:
// - the middle of the two-GEMM update: Pc = s * (P ⊙ codes), rounded to the operands' dtype (at prefill
//   sizes and ranks above 16 the update runs as P = x V and Y = Pc U^T in cuBLAS, which read x and write
//   Y close to the device's bandwidth);
// - the backward's coefficients s G ⊙ c (for dV), s P ⊙ c (for dU) and s G ⊙ P (dcodes) in one pass,
//   where composed PyTorch took nine elementwise launches.
#include <algorithm>

#include "../common/common.cuh"
#include "launchers.h"

namespace bem {
namespace {

template <typename T>
__global__ void scale_codes_kernel(const float* P, const T* codes, T* out, int64_t count, float scale) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float c = codes ? to_acc(codes[i]) : 1.f;
    out[i] = from_acc<T>(scale * P[i] * c);
  }
}

template <typename T>
__global__ void backward_coefficients_kernel(const float* G, const float* P, const T* codes, T* g_c, T* p_c,
                                             T* g_p, int64_t count, float scale) {
  const int64_t stride = (int64_t)gridDim.x * blockDim.x;
  for (int64_t i = (int64_t)blockIdx.x * blockDim.x + threadIdx.x; i < count; i += stride) {
    const float c = codes ? to_acc(codes[i]) : 1.f;
    store_coefficients<T>(G[i], P[i], c, scale, i, g_c, p_c, g_p);
  }
}

constexpr int kThreads = 256;
int blocks_for(int64_t count) { return (int)std::min<int64_t>((count + kThreads - 1) / kThreads, 4096); }

}  // namespace

cudaError_t launch_backward_coefficients(DType dtype, const float* G, const float* P, const void* codes, void* g_c,
                                         void* p_c, void* g_p, int64_t count, float scale, cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    backward_coefficients_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(
        G, P, static_cast<const T*>(codes), static_cast<T*>(g_c), static_cast<T*>(p_c), static_cast<T*>(g_p), count,
        scale);
    return cudaGetLastError();
  });
}

cudaError_t launch_scale_codes(DType dtype, const float* P, const void* codes, void* out, int64_t count, float scale,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_codes_kernel<T><<<blocks_for(count), kThreads, 0, stream>>>(P, static_cast<const T*>(codes), static_cast<T*>(out),
                                                           count, scale);
    return cudaGetLastError();
  });
}

}  // namespace bem
