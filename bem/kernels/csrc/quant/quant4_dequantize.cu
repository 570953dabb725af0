// A 4-bit weight of bitsandbytes' layout dequantized to 16 bits (N x K, row-major), for the calls above decode
// sizes: the prefill and training products then run on the low-rank family's GEMM with the update inside. Each
// thread takes eight values (four bytes, one block: blocksize is a multiple of 32) and writes them as one 16-byte
// store; a value is code[nibble] * absmax rounded once to the output type, as bitsandbytes' own dequantization.
#include <algorithm>

#include "../common/common.cuh"
#include "quant4_layout.cuh"
#include "quant_launchers.h"

namespace bem {
namespace {

constexpr int kThreads = 256;

template <typename T>
__global__ void __launch_bounds__(kThreads) quant4_dequantize_kernel(const Quant4DequantArgs a) {
  __shared__ float code[16];
  if (threadIdx.x < 16) code[threadIdx.x] = a.code[threadIdx.x];
  __syncthreads();
  const int64_t groups = a.numel / 8;
  T* W = static_cast<T*>(a.out);
  for (int64_t g = (int64_t)blockIdx.x * kThreads + threadIdx.x; g < groups; g += (int64_t)gridDim.x * kThreads) {
    const uint32_t packed = __ldg(reinterpret_cast<const uint32_t*>(a.W) + g);
    const float s = block_absmax(a, g * 8 / a.blocksize);
    float v[8];
#pragma unroll
    for (int b = 0; b < 4; ++b) {
      const uint32_t byte = (packed >> (8 * b)) & 0xffu;
      v[2 * b] = code[byte >> 4] * s;
      v[2 * b + 1] = code[byte & 0xfu] * s;
    }
    reinterpret_cast<uint4*>(W)[g] = pack8<T>(v);
  }
}

}  // namespace

cudaError_t launch_quant4_dequantize(DType dtype, const Quant4DequantArgs& args, int num_sms, cudaStream_t stream) {
  if (args.numel == 0) return cudaSuccess;
  if (args.numel % 8 || args.blocksize % 32 || args.blocksize <= 0) return cudaErrorInvalidValue;
  const int64_t groups = args.numel / 8;
  // enough blocks to fill the device several times over; the grid-stride loop takes the rest
  const int64_t blocks = std::min<int64_t>((groups + kThreads - 1) / kThreads, (int64_t)num_sms * 16);
  switch (dtype) {
    case DType::kHalf: quant4_dequantize_kernel<__half><<<(int)blocks, kThreads, 0, stream>>>(args); break;
    case DType::kBFloat16: quant4_dequantize_kernel<__nv_bfloat16><<<(int)blocks, kThreads, 0, stream>>>(args); break;
    default: return cudaErrorInvalidValue;
  }
  return cudaGetLastError();
}

}  // namespace bem
