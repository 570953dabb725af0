// The gradient of each token's stabilised denominator, for the mLSTM backward:
//   beta_t = -(dh_t·h_t) / n_t · sign(den_t) where |den_t| > exp(-m_t), else 0,   n_t = max(|den_t|, exp(-m_t)).
// One warp per token row; dh·h accumulates in float32 (16-byte loads where the rows allow them).
#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

constexpr int kBetaWarps = 8;

template <typename T>
__global__ void __launch_bounds__(kBetaWarps * 32) mlstm_beta_kernel(const MlstmBetaParams p) {
  const int lane = threadIdx.x % 32;
  const int64_t row = (int64_t)blockIdx.x * kBetaWarps + threadIdx.x / 32;
  if (row >= p.rows) return;
  const T* dh = static_cast<const T*>(p.dh) + row * p.DV;
  const T* h = static_cast<const T*>(p.h) + row * p.DV;
  float dot = 0.f;
  if (p.vec) {
    constexpr int kVec = 16 / (int)sizeof(T);
    for (int c = lane * kVec; c < p.DV; c += 32 * kVec) {
      const uint4 a = *reinterpret_cast<const uint4*>(dh + c), b = *reinterpret_cast<const uint4*>(h + c);
      const T* x = reinterpret_cast<const T*>(&a);
      const T* y = reinterpret_cast<const T*>(&b);
#pragma unroll
      for (int i = 0; i < kVec; ++i) dot += to_f(x[i]) * to_f(y[i]);
    }
  } else {
    for (int c = lane; c < p.DV; c += 32) dot += to_f(dh[c]) * to_f(h[c]);
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) dot += __shfl_xor_sync(0xffffffffu, dot, o);
  if (lane == 0) {
    const float den = p.den_tok[row], m = p.m_tok[row];
    const float floor = wexp<T>(-m);
    const float n = normaliser<T>(den, m);
    p.beta[row] = fabsf(den) > floor ? -wdiv<T>(dot, n) * copysignf(1.f, den) : 0.f;
  }
}

template <typename T> cudaError_t launch(const MlstmBetaParams& p, cudaStream_t stream) {
  const int64_t blocks = (p.rows + kBetaWarps - 1) / kBetaWarps;
  mlstm_beta_kernel<T><<<(unsigned)blocks, kBetaWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlstm_beta(DType dtype, const MlstmBetaParams& p, cudaStream_t stream) {
  if (p.rows == 0) return cudaSuccess;
  return dispatch_dtype(dtype, [&](auto type) { return launch<decltype(type)>(p, stream); });
}

}  // namespace bem
