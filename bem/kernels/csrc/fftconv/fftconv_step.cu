// The decoding step's kernel (fftconv_step.cuh): one launch per call.
#include "fftconv_launch.cuh"
#include "fftconv_step.cuh"

namespace bem {
namespace fftconv {
namespace {

template <typename T, typename Tk>
__global__ void __launch_bounds__(kStepThreads) step_kernel(const StepParams<T, Tk> p) {
  step_body<T, Tk>(p);
}

}  // namespace

cudaError_t launch_step(Dtype dtype, Dtype k_dtype, const StepArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_dtype(k_dtype, [&](auto k_zero) {
      using Tk = decltype(k_zero);
      const StepParams<T, Tk> p{static_cast<T*>(args.history),        static_cast<const T*>(args.u),
                                static_cast<const T*>(args.pregate),  static_cast<const T*>(args.postgate),
                                static_cast<const Tk*>(args.k),       args.D,
                                args.position,                        static_cast<T*>(args.y),
                                args.position_value,                  args.H,
                                args.Lmax,                            args.Lk,
                                args.gelu};
      step_kernel<T, Tk><<<args.rows, kStepThreads, 0, stream>>>(p);
      return cudaGetLastError();
    });
  });
}

}  // namespace fftconv
}  // namespace bem
