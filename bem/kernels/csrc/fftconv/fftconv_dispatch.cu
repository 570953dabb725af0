// The filter's spectrum kernel, and the element type's choice of the forward and backward kernels.
#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {

template <int M, typename T>
__global__ void __launch_bounds__(M / 32, Plan<M>::kMinBlocks) spectrum_kernel(const SpectrumParams<T> p) {
  spectrum_body<M>(p);
}

// k read in its own dtype (a float32 copy of a bf16 filter cost a pass over it)
cudaError_t launch_spectrum(int M, const SpectrumArgs& args, int num_sms, cudaStream_t stream) {
  return with_dtype(args.dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_spectrum_length(M, [&](auto m) {
      constexpr int kM = decltype(m)::value;
      const int resident = resident_blocks(spectrum_kernel<kM, T>, kM / 32, Plan<kM>::kSmemBytes);
      if (resident == 0) return cudaErrorInvalidConfiguration;
      const SpectrumParams<T> p{static_cast<const T*>(args.k), args.S, args.H, args.Lk, args.taps};
      spectrum_kernel<kM, T><<<grid_for(args.H, resident, num_sms), kM / 32, Plan<kM>::kSmemBytes, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_forward(Dtype dtype, int M, const ForwardArgs& args, int num_sms, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) { return launch_forward_typed<decltype(zero)>(M, args, num_sms, stream); });
}

int block_smem_bytes(int M) {
  int bytes = 0;
  with_spectrum_length(M, [&](auto m) {
    bytes = Plan<decltype(m)::value>::kSmemBytes;
    return cudaSuccess;
  });
  return bytes;
}

int backward_blocks(Dtype dtype, int M, int64_t items, int num_sms, BackwardPass pass, bool g_rows) {
  int blocks = 0;
  with_dtype(dtype, [&](auto zero) {
    blocks = backward_blocks_typed<decltype(zero)>(M, items, num_sms, pass, g_rows);
    return cudaSuccess;
  });
  return blocks;
}

int64_t backward_scratch_per_block(int M) {
  int64_t floats = 0;
  with_spectrum_length(M, [&](auto m) {
    floats = backward_scratch_floats<decltype(m)::value>();
    return cudaSuccess;
  });
  return floats;
}

cudaError_t launch_backward(Dtype dtype, int M, const BackwardArgs& args, int blocks, cudaStream_t stream) {
  return with_dtype(dtype,
                    [&](auto zero) { return launch_backward_typed<decltype(zero)>(M, args, blocks, stream); });
}

}  // namespace fftconv
}  // namespace bem
