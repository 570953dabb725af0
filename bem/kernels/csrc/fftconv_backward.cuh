// The backward for L <= 16384: one thread block per (h, group of batch rows), each row's FFTs in shared
// memory (fftconv_block.cuh); dk's spectrum accumulates over the group's rows in the block's scratch.
// Instantiated per element type by fftconv_backward_{f16,bf16,f32}.cu.
#pragma once

#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {

template <int M, typename T, BackwardPass kPass>
__global__ void __launch_bounds__(M / 32, Plan<M>::kMinBlocks) backward_kernel(const BackwardParams<T> p) {
  backward_body<M, T, kPass>(p);
}

// f(std::integral_constant<BackwardPass, pass>)
template <typename F>
inline cudaError_t with_pass(BackwardPass pass, F&& f) {
  switch (pass) {
    case BackwardPass::kFused: return f(std::integral_constant<BackwardPass, BackwardPass::kFused>());
    case BackwardPass::kInputs: return f(std::integral_constant<BackwardPass, BackwardPass::kInputs>());
    case BackwardPass::kFilter: return f(std::integral_constant<BackwardPass, BackwardPass::kFilter>());
    case BackwardPass::kActivation: return f(std::integral_constant<BackwardPass, BackwardPass::kActivation>());
  }
  return cudaErrorInvalidValue;
}

template <typename T>
int backward_blocks_typed(int M, int64_t items, int num_sms, BackwardPass pass) {
  int blocks = 0;
  with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    return with_pass(pass, [&](auto which) {
      constexpr BackwardPass kPass = decltype(which)::value;
      blocks = grid_for(items, resident_blocks(backward_kernel<kM, T, kPass>, kM / 32, Plan<kM>::kSmemBytes),
                        num_sms);
      return cudaSuccess;
    });
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
                              args.g_rows,
                              args.B,                               args.H,
                              args.L,                               args.taps,
                              args.groups,                          args.rows_per_group,
                              args.gelu,                            args.need_c};
    return with_pass(args.pass, [&](auto which) {
      backward_kernel<kM, T, decltype(which)::value><<<blocks, kM / 32, Plan<kM>::kSmemBytes, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace fftconv
}  // namespace bem
