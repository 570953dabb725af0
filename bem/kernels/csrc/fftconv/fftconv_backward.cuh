// The backward for L <= 16384, in up to three launches (fftconv_pass.h), each row's FFTs in shared memory
// (fftconv_block.cuh); dk's spectrum accumulates over a group of batch rows in the block's scratch.
// Instantiated per element type by fftconv_backward_{f16,bf16,f32}.cu.
#pragma once

#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {

template <int M, typename T, BackwardPass kPass, bool kGRows>
__global__ void __launch_bounds__(M / 32, Plan<M>::kMinBlocks) backward_kernel(const BackwardParams<T> p) {
  backward_body<M, T, kPass, kGRows>(p);
}

// f(kernel) for the kernel of this pass, g read from g_rows or formed from dy (the activation pass writes it)
template <int M, typename T, typename F>
inline cudaError_t with_backward_kernel(BackwardPass pass, bool g_rows, F&& f) {
  switch (pass) {
    case BackwardPass::kActivation:
      return g_rows ? f(backward_kernel<M, T, BackwardPass::kActivation, true>) : cudaErrorInvalidValue;
    case BackwardPass::kInputs:
      return g_rows ? f(backward_kernel<M, T, BackwardPass::kInputs, true>)
                    : f(backward_kernel<M, T, BackwardPass::kInputs, false>);
    case BackwardPass::kFilter:
      return g_rows ? f(backward_kernel<M, T, BackwardPass::kFilter, true>)
                    : f(backward_kernel<M, T, BackwardPass::kFilter, false>);
  }
  return cudaErrorInvalidValue;
}

template <typename T>
int backward_blocks_typed(int M, int64_t items, int num_sms, BackwardPass pass, bool g_rows) {
  int blocks = 0;
  with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    return with_backward_kernel<kM, T>(pass, g_rows, [&](auto kernel) {
      blocks = grid_for(items, resident_blocks(kernel, kM / 32, Plan<kM>::kSmemBytes), num_sms);
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
                              args.g_rows,                          args.B,
                              args.H,                               args.L,
                              args.taps,                            args.groups,
                              args.rows_per_group,                  args.gelu};
    return with_backward_kernel<kM, T>(args.pass, args.g_rows != nullptr, [&](auto kernel) {
      kernel<<<blocks, kM / 32, Plan<kM>::kSmemBytes, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace fftconv
}  // namespace bem
