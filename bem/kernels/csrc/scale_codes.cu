// The middle step of the two-GEMM update: Pc = s * (P ⊙ codes), rounded to the operands' dtype.
// At prefill sizes and ranks above 16 the update runs as P = x V and Y = Pc U^T in cuBLAS, which read x
// and write Y close to the device's bandwidth; this kernel is the only pass in between (M x r values).
#include <algorithm>

#include "common.cuh"
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

}  // namespace

cudaError_t launch_scale_codes(DType dtype, const float* P, const void* codes, void* out, int64_t count, float scale,
                               cudaStream_t stream) {
  if (count == 0) return cudaSuccess;
  constexpr int kThreads = 256;
  const int blocks = (int)std::min<int64_t>((count + kThreads - 1) / kThreads, 4096);
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    scale_codes_kernel<T><<<blocks, kThreads, 0, stream>>>(P, static_cast<const T*>(codes), static_cast<T*>(out),
                                                           count, scale);
    return cudaGetLastError();
  });
}

}  // namespace bem
