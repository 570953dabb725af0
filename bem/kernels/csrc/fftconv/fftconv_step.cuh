// The decoding step's body: one block per (b, h) row writes the new pregated input into the history and
// takes the dot product of the history with the reversed filter, its warps splitting the history and
// reducing. Kept free of torch headers (fftconv_block.cuh's emulation compiles it too).
#pragma once

#include "fftconv_block.cuh"

namespace bem {
namespace fftconv {

constexpr int kStepThreads = 256;

template <typename T, typename Tk>
struct StepParams {
  T* history;
  const T* u;
  const T* pre;
  const T* post;
  const Tk* k;
  const float* D;
  const int64_t* position;
  T* y;
  int64_t position_value;
  int H, Lmax, Lk;
  bool gelu;
};

template <typename T, typename Tk>
BEM_FFT_FN void step_body(const StepParams<T, Tk>& a) {
#if defined(__CUDACC__)
  __shared__ float partial[kStepThreads / 32];
#else
  float* partial = reinterpret_cast<float*>(bem_fft_emulated_smem());
#endif
  const int row = blockIdx.x, h = row % a.H, tid = threadIdx.x;
  const int64_t p = a.position ? *a.position : a.position_value;
  const bool valid = p >= 0 && p < a.Lmax;
  T* history = a.history + (int64_t)row * a.Lmax;
  const Tk* k = a.k + (int64_t)h * a.Lk;
  float acc = 0.0f;
  if (valid) {
    // past positions s = p - taps + 1 .. p - 1 against k[p - s]; the current one is added below
    const int64_t first = p - (p + 1 < a.Lk ? p + 1 : a.Lk) + 1;
#pragma unroll 4
    for (int64_t s = first + tid; s < p; s += kStepThreads) acc += to_f(k[p - s]) * to_f(history[s]);
  }
#pragma unroll
  for (int offset = 16; offset > 0; offset /= 2) acc += __shfl_xor_sync(0xffffffffu, acc, offset);
  if (tid % 32 == 0) partial[tid / 32] = acc;
  __syncthreads();
  if (tid != 0) return;
  if (!valid) {
    a.y[row] = from_f<T>(NAN);
    return;
  }
  float conv = 0.0f;
#pragma unroll
  for (int w = 0; w < kStepThreads / 32; ++w) conv += partial[w];
  float v = to_f(a.u[row]);
  if (a.pre) v *= to_f(a.pre[row]);
  history[p] = from_f<T>(v);
  float c = conv + to_f(k[0]) * v;
  if (a.D) c += a.D[h] * v;
  float out = a.gelu ? gelu_f(c) : c;
  if (a.post) out *= to_f(a.post[row]);
  a.y[row] = from_f<T>(out);
}

}  // namespace fftconv
}  // namespace bem
