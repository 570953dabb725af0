// The mLSTM recurrent step (decoding): one token per (batch row, head) from the float32 state into a new
// one, one launch for all rows. One block per (row, 32 columns of DV) of 8 warps: lane = column, warp =
// every 8th row of C, so each warp reads and writes 128 contiguous bytes of C per row.
//   m' = max(log σ(f̃) + m, ĩ),  f' = exp(log σ(f̃) + m - m'),  i' = exp(ĩ - m')      (both <= 1)
//   C' = f' C + i' k vᵀ,  n' = f' n + i' k,  h = C'ᵀ q̂ / max(|n'·q̂|, exp(-m'))
#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

constexpr int kStepWarps = 8;
constexpr int kStepCols = 32;

template <typename T>
__global__ void __launch_bounds__(kStepWarps * 32) mlstm_step_kernel(const MlstmStepParams p) {
  __shared__ float num_s[kStepWarps][kStepCols];
  __shared__ float den_s[kStepWarps];
  const int bh = blockIdx.x, col = blockIdx.y * kStepCols + threadIdx.x % 32, warp = threadIdx.x / 32;
  const int lane = threadIdx.x % 32;
  const T* q = static_cast<const T*>(p.q) + (int64_t)bh * p.DK;
  const T* k = static_cast<const T*>(p.k) + (int64_t)bh * p.DK;
  const float lf = log_sigmoid<T>(load_gate<T>(p.fgate, p.gates_fp32, bh));
  const float ig = load_gate<T>(p.igate, p.gates_fp32, bh);
  const float m_prev = p.m[bh];
  const float m_next = fmaxf(lf + m_prev, ig);
  const float carry = wexp<T>(lf + m_prev - m_next), write = wexp<T>(ig - m_next);

  // n' and n'·q̂: every block computes them (DK values), the first column block stores n'.
  float den = 0.f;
  for (int d = threadIdx.x; d < p.DK; d += kStepWarps * 32) {
    const float n_new = carry * p.n[(int64_t)bh * p.DK + d] + write * to_f(k[d]);
    den += n_new * to_f(q[d]);
    if (blockIdx.y == 0) p.n_out[(int64_t)bh * p.DK + d] = n_new;
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) den += __shfl_xor_sync(0xffffffffu, den, o);
  if (lane == 0) den_s[warp] = den;

  float num = 0.f;
  if (col < p.DV) {
    const float wv = write * to_f(static_cast<const T*>(p.v)[(int64_t)bh * p.DV + col]);
    const float* C = p.C + (int64_t)bh * p.DK * p.DV + col;
    float* C_out = p.C_out + (int64_t)bh * p.DK * p.DV + col;
#pragma unroll 4
    for (int d = warp; d < p.DK; d += kStepWarps) {
      const float c_new = carry * C[(int64_t)d * p.DV] + wv * to_f(k[d]);
      C_out[(int64_t)d * p.DV] = c_new;
      num += c_new * to_f(q[d]);
    }
  }
  num_s[warp][lane] = num;
  __syncthreads();
  if (warp == 0) {
    float total = 0.f, den_total = 0.f;
#pragma unroll
    for (int w = 0; w < kStepWarps; ++w) {
      total += num_s[w][lane];
      den_total += den_s[w];
    }
    // h = (C'ᵀ q / √d) / max(|n'·q / √d|, exp(-m'))
    const float inv = wdiv<T>(1.f, normaliser<T>(den_total * p.scale, m_next));
    if (col < p.DV) static_cast<T*>(p.h)[(int64_t)bh * p.DV + col] = from_f<T>(total * p.scale * inv);
    if (blockIdx.y == 0 && lane == 0) p.m_out[bh] = m_next;
  }
}

template <typename T>
cudaError_t launch(const MlstmStepParams& p, cudaStream_t stream) {
  const dim3 grid(p.BH, (p.DV + kStepCols - 1) / kStepCols);
  mlstm_step_kernel<T><<<grid, kStepWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlstm_step(DType dtype, const MlstmStepParams& p, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto type) { return launch<decltype(type)>(p, stream); });
}

}  // namespace bem
