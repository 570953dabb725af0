// The forward convolution for L <= 16384: one thread block per row in shared memory (fftconv_block.cuh),
// a grid of as many blocks as the GPU holds at once, looping over the rows. Instantiated per element type
// by fftconv_forward_{f16,bf16,f32}.cu.
#pragma once

#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {

template <int M, typename T>
__global__ void __launch_bounds__(M / 32, Plan<M>::kMinBlocks) forward_kernel(const ForwardParams<T> p) {
  forward_body<M, T>(p);
}

template <typename T>
cudaError_t launch_forward_typed(int M, const ForwardArgs& args, int num_sms, cudaStream_t stream) {
  return with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    const int resident = resident_blocks(forward_kernel<kM, T>, kM / 32, Plan<kM>::kSmemBytes);
    if (resident == 0) return cudaErrorInvalidConfiguration;
    const ForwardParams<T> p{static_cast<const T*>(args.u),        static_cast<const T*>(args.pregate),
                             static_cast<const T*>(args.postgate), args.S,
                             args.D,                               static_cast<T*>(args.y),
                             args.rows,                            args.H,
                             args.L,                               args.gelu};
    forward_kernel<kM, T><<<grid_for(args.rows, resident, num_sms), kM / 32, Plan<kM>::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace fftconv
}  // namespace bem
