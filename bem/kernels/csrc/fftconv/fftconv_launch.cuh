// Launch helpers of the block FFT kernels: the dynamic shared-memory limit, the blocks per multiprocessor,
// the element type and spectrum length chosen at run time.
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include "fftconv.h"
#include "fftconv_rows.cuh"

namespace bem {
namespace fftconv {

// Blocks of `kernel` one multiprocessor holds with `smem` bytes each (after raising its dynamic shared
// memory limit, which the blocks of M >= 8192 need); 0 when the device refuses.
template <typename Kernel>
inline int resident_blocks(Kernel kernel, int threads, int smem) {
  if (cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem) != cudaSuccess) return 0;
  int blocks = 0;
  if (cudaOccupancyMaxActiveBlocksPerMultiprocessor(&blocks, kernel, threads, smem) != cudaSuccess) return 0;
  return blocks;
}

inline int grid_for(int64_t work, int resident, int num_sms) {
  const int64_t full = (int64_t)resident * num_sms;
  return (int)(work < full ? work : full);
}

template <typename F>
inline cudaError_t with_spectrum_length(int M, F&& f) {
  switch (M) {
    case 1024: return f(std::integral_constant<int, 1024>());
    case 2048: return f(std::integral_constant<int, 2048>());
    case 4096: return f(std::integral_constant<int, 4096>());
    case 8192: return f(std::integral_constant<int, 8192>());
    case 16384: return f(std::integral_constant<int, 16384>());
    default: return cudaErrorInvalidValue;
  }
}

template <typename F>
inline cudaError_t with_dtype(Dtype dtype, F&& f) {
  switch (dtype) {
    case Dtype::kHalf: return f(__half());
    case Dtype::kBFloat16: return f(__nv_bfloat16());
    case Dtype::kFloat: return f(float());
  }
  return cudaErrorInvalidValue;
}

}  // namespace fftconv
}  // namespace bem

namespace bem {
namespace fftconv {

// Per element type, each in a file of its own (fftconv_{forward,backward}_{f16,bf16,f32}.cu) so that the
// builds run in parallel: the backward's kernels took four minutes to compile in one file.
template <typename T>
cudaError_t launch_forward_typed(int M, const ForwardArgs& args, int num_sms, cudaStream_t stream);
template <typename T>
int backward_blocks_typed(int M, int64_t items, int num_sms, BackwardPass pass, bool g_rows);
template <typename T>
cudaError_t launch_backward_typed(int M, const BackwardArgs& args, int blocks, cudaStream_t stream);

}  // namespace fftconv
}  // namespace bem
