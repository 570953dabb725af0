// The backward for L <= 16384: one thread block per (h, group of batch rows), each row's FFTs in shared
// memory (fftconv_block.cuh); dk's spectrum accumulates over the group's rows in the block's scratch.
// Instantiated per element type by fftconv_backward_{f16,bf16,f32}.cu.
#pragma once

#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {

template <int M, typename T>
__global__ void __launch_bounds__(M / 32, Plan<M>::kMinBlocks) backward_kernel(const BackwardParams<T> p) {
  backward_body<M, T>(p);
}

template <typename T>
int backward_blocks_typed(int M, int64_t items, int num_sms) {
  int blocks = 0;
  with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    blocks = grid_for(items, resident_blocks(backward_kernel<kM, T>, kM / 32, Plan<kM>::kSmemBytes), num_sms);
    return cudaSuccess;
  });
  return blocks;
}

template <typename T>
cudaError_t launch_backward_typed(int M, const BackwardArgs& args, int blocks, cudaStream_t stream) {
  if (blocks <= 0) return cudaErrorInvalidConfiguration;
  return with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    const BackwardParams<T> p{static_cast<const T*>(args.dy),       static_cast<const T*>(args.u),
                              static_cast<const T*>(args.pregate),  static_cast<const T*>(args.postgate),
                              args.S,                               args.D,
                              static_cast<T*>(args.du),             static_cast<T*>(args.dpregate),
                              static_cast<T*>(args.dpostgate),      args.dk_part,
                              args.dD_part,                         args.scratch,
                              args.B,                               args.H,
                              args.L,                               args.taps,
                              args.groups,                          args.rows_per_group,
                              args.gelu,                            args.need_c};
    backward_kernel<kM, T><<<blocks, kM / 32, Plan<kM>::kSmemBytes, stream>>>(p);
    return cudaGetLastError();
  });
}

}  // namespace fftconv
}  // namespace bem
