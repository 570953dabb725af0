// The decoding step: one block per (b, h) row writes the new pregated input into the history and takes the
// dot product of the history with the reversed filter, its warps splitting the history and reducing.
#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {
namespace {

constexpr int kStepThreads = 256;

template <typename T, typename Tk>
__global__ void __launch_bounds__(kStepThreads) step_kernel(const StepArgs a) {
  __shared__ float partial[kStepThreads / 32];
  const int row = blockIdx.x, h = row % a.H;
  const int64_t p = a.position ? *a.position : a.position_value;
  const bool valid = p >= 0 && p < a.Lmax;
  T* history = static_cast<T*>(a.history) + (int64_t)row * a.Lmax;
  const Tk* k = static_cast<const Tk*>(a.k) + (int64_t)h * a.Lk;
  float acc = 0.0f;
  if (valid) {
    // past positions s = p - taps + 1 .. p - 1 against k[p - s]; the current one is added below
    const int64_t first = p - (p + 1 < a.Lk ? p + 1 : a.Lk) + 1;
#pragma unroll 4
    for (int64_t s = first + threadIdx.x; s < p; s += kStepThreads) acc += to_f(k[p - s]) * to_f(history[s]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (threadIdx.x % 32 == 0) partial[threadIdx.x / 32] = acc;
  __syncthreads();
  if (threadIdx.x != 0) return;
  T* y = static_cast<T*>(a.y);
  if (!valid) {
    y[row] = from_f<T>(NAN);
    return;
  }
  float conv = 0.0f;
#pragma unroll
  for (int w = 0; w < kStepThreads / 32; ++w) conv += partial[w];
  float v = to_f(static_cast<const T*>(a.u)[row]);
  if (a.pregate) v *= to_f(static_cast<const T*>(a.pregate)[row]);
  history[p] = from_f<T>(v);
  float c = conv + to_f(k[0]) * v;
  if (a.D) c += a.D[h] * v;
  float out = a.gelu ? gelu_f(c) : c;
  if (a.postgate) out *= to_f(static_cast<const T*>(a.postgate)[row]);
  y[row] = from_f<T>(out);
}

}  // namespace

cudaError_t launch_step(Dtype dtype, Dtype k_dtype, const StepArgs& args, cudaStream_t stream) {
  if (args.rows == 0) return cudaSuccess;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_dtype(k_dtype, [&](auto k_zero) {
      using Tk = decltype(k_zero);
      step_kernel<T, Tk><<<args.rows, kStepThreads, 0, stream>>>(args);
      return cudaGetLastError();
    });
  });
}

}  // namespace fftconv
}  // namespace bem
