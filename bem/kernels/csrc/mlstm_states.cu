// The mLSTM chunk-state pass: one block per (row, 64 x 64 tile of the DK x DV state) walks the chunks in
// sequence, keeping its tile of the state in float32 registers (mma accumulators).
//
// Forward, chunk c with stabiliser m (the state entering it is stored first):
//   M = max(m, pm[63]),  C <- exp(m - M) C + sum_s exp(a_s - M) k_s v_sᵀ,  n likewise with k_s,  m <- G + M
// (G the chunk's total log-forget, a_s = ĩ_s - g_s: every weight is <= 1).
// Reverse, from the last chunk back (the gradient of the state after chunk c is stored first):
//   R <- exp(G + m_c - m_{c+1}) R + sum_t exp(m_c - M_t) / √d q_t [dh_t / n_t, beta_t]ᵀ
// with the forward's stabilisers, so every weight is again <= 1.
#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

template <typename T, typename StateT>
__global__ void __launch_bounds__(kThreads) mlstm_states_kernel(const MlstmStatesParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int ST = Tile<T>::stride;
  // Two buffers of [token][d] keys and [token][dv] values (scaled by each token's weight): the next chunk's
  // tiles load while this one's are used.
  T* keys_buf = reinterpret_cast<T*>(smem_raw);
  T* vals_buf = keys_buf + 2 * tile_elems<T>();
  // 16-bit inputs: the weighted values as hi + lo, two 16-bit numbers whose sum holds the float32 product
  // w ⊙ v to about 16 bits, so the state (returned in float32) does not carry one 16-bit rounding per term.
  T* lo_s = vals_buf + 2 * tile_elems<T>();
  constexpr bool kSplit = sizeof(T) == 2;
  __shared__ GateT<T> g_s[L], a_s[L], pm_s[L];
  __shared__ float w_s[L], wn_s[L];
  __shared__ float n_part[2][64];
  __shared__ float step_s[2];  // decay of the carried state, next stabiliser

  const MlstmShape& sh = p.shape;
  const int bh = blockIdx.x, d0 = blockIdx.y * 64, v0 = blockIdx.z * 64;
  const int warp = threadIdx.x / 32, tid = threadIdx.x;
  const bool owns_n = blockIdx.z == 0;
  const bool owns_m = blockIdx.y == 0 && blockIdx.z == 0;
  const T* keys = static_cast<const T*>(p.keys) + (int64_t)bh * sh.S * sh.DK;
  const T* vals = static_cast<const T*>(p.values) + (int64_t)bh * sh.S * sh.DV;
  StateT* states = static_cast<StateT*>(p.C_states) + (int64_t)bh * sh.NC * sh.DK * sh.DV;
  const int64_t state_size = (int64_t)sh.DK * sh.DV;
  const auto chunk_at = [&](int step) { return p.reverse ? sh.NC - 1 - step : step; };

  float acc[8][4];
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + warp * 16 + acc_row(e), dv = v0 + acc_col(nt, e);
      acc[nt][e] = p.C_in != nullptr && d < sh.DK && dv < sh.DV ? p.C_in[bh * state_size + (int64_t)d * sh.DV + dv] : 0.f;
    }
  const int my_d = d0 + tid;  // threads 0..63 keep n for one d each
  float n_val = 0.f, n_decay = 0.f;
  if (owns_n && tid < 64 && p.n_in != nullptr && my_d < sh.DK) n_val = p.n_in[(int64_t)bh * sh.DK + my_d];
  float m = (!p.reverse && p.m_in != nullptr) ? p.m_in[bh] : 0.f;

  stage_tile(keys_buf, keys, sh.DK, chunk_at(0) * L, sh.S, d0, sh.DK, sh.vec_qk);
  stage_tile(vals_buf, vals, sh.DV, chunk_at(0) * L, sh.S, v0, sh.DV, sh.vec_v);
  cp_async_commit();
  ChunkGates gates{};
  if (warp == 0) gates = load_chunk_gates<T>(sh, p.igate, p.fgate, bh, chunk_at(0));

  for (int step = 0; step < sh.NC; ++step) {
    const int c = chunk_at(step);
    T* keys_s = keys_buf + (step & 1) * tile_elems<T>();
    T* vals_s = vals_buf + (step & 1) * tile_elems<T>();
    // The previous chunk's n: its two halves' partial sums (before the barrier that ended that chunk).
    if (step > 0 && owns_n && tid < 64) n_val = n_decay * n_val + n_part[0][tid] + n_part[1][tid];
    // Store the state (forward: entering chunk c; reverse: the gradient of the state after chunk c).
    StateT* out = states + (int64_t)c * state_size;
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int d = d0 + warp * 16 + acc_row(e), dv = v0 + acc_col(nt, e);
        if (d < sh.DK && dv < sh.DV) out[(int64_t)d * sh.DV + dv] = from_f<StateT>(acc[nt][e]);
      }
    if (owns_n && tid < 64 && my_d < sh.DK) p.n_states[((int64_t)bh * sh.NC + c) * sh.DK + my_d] = n_val;
    if (!p.reverse && owns_m && tid == 0) p.m_states[(int64_t)bh * (sh.NC + 1) + c] = m;

    const bool has_next = step + 1 < sh.NC;
    if (has_next) {
      const int next = chunk_at(step + 1);
      stage_tile(keys_buf + ((step + 1) & 1) * tile_elems<T>(), keys, sh.DK, next * L, sh.S, d0, sh.DK, sh.vec_qk);
      stage_tile(vals_buf + ((step + 1) & 1) * tile_elems<T>(), vals, sh.DV, next * L, sh.S, v0, sh.DV, sh.vec_v);
      cp_async_commit();
    }
    if (warp == 0) {
      scan_chunk_gates<T>(gates, g_s, a_s, pm_s);
      if (has_next) gates = load_chunk_gates<T>(sh, p.igate, p.fgate, bh, chunk_at(step + 1));
    }
    __syncthreads();
    if (tid < L) {
      const int t = c * L + tid;
      if (!p.reverse) {
        const GateT<T> M = gmax(static_cast<GateT<T>>(m), pm_s[L - 1]);
        const float w = wexp<T>(a_s[tid] - M);  // 0 beyond the last token (a = -inf)
        w_s[tid] = w;
        wn_s[tid] = w;
        if (tid == 0) {
          step_s[0] = wexp<T>(m - M);
          step_s[1] = static_cast<float>(g_s[L - 1] + M);
        }
      } else {
        const float m_c = p.m_states[(int64_t)bh * (sh.NC + 1) + c];
        const GateT<T> M = gmax(static_cast<GateT<T>>(m_c), pm_s[tid]);
        float w = 0.f, wn = 0.f;
        if (t < sh.S) {
          const int64_t row = (int64_t)bh * sh.S + t;
          const float e = wexp<T>(m_c - M) * sh.scale;
          w = wdiv<T>(e, normaliser<T>(p.den_tok[row], p.m_tok[row]));
          wn = e * p.beta[row];
        }
        w_s[tid] = w;
        wn_s[tid] = wn;
        if (tid == 0) {
          const float m_next = p.m_states[(int64_t)bh * (sh.NC + 1) + c + 1];
          step_s[0] = wexp<T>(g_s[L - 1] + m_c - m_next);
          step_s[1] = 0.f;
        }
      }
    }
    if (has_next) {
      cp_async_wait<1>();  // this chunk's tiles; the next chunk's stay in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    for (int idx = tid; idx < L * 64; idx += kThreads) {
      const int r = idx / 64, col = idx % 64;
      const float x = to_f(vals_s[r * ST + col]) * w_s[r];
      const T hi = tile_f<T>(x);
      vals_s[r * ST + col] = hi;
      if (kSplit) lo_s[r * ST + col] = tile_f<T>(x - to_f(hi));
    }
    __syncthreads();
    const float decay = step_s[0];
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] *= decay;
    warp_mma<T, true, true>(acc, keys_s, warp * 16, vals_s);  // + keysᵀ (w ⊙ values)
    if (kSplit) warp_mma<T, true, true>(acc, keys_s, warp * 16, lo_s);
    if (owns_n) {  // n's sum over the chunk's 64 tokens in two halves of 32
      const int col = tid % 64, half = tid / 64;
      float sum = 0.f;
#pragma unroll 8
      for (int r = half * 32; r < half * 32 + 32; ++r) sum += wn_s[r] * to_f(keys_s[r * ST + col]);
      n_part[half][col] = sum;
    }
    n_decay = decay;
    if (!p.reverse) m = step_s[1];
    __syncthreads();  // the next chunk rewrites the gates, the weights and this chunk's buffers
  }
  if (owns_n && tid < 64) n_val = n_decay * n_val + n_part[0][tid] + n_part[1][tid];

#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + warp * 16 + acc_row(e), dv = v0 + acc_col(nt, e);
      if (d < sh.DK && dv < sh.DV) p.C_out[bh * state_size + (int64_t)d * sh.DV + dv] = acc[nt][e];
    }
  if (owns_n && tid < 64 && my_d < sh.DK) p.n_out[(int64_t)bh * sh.DK + my_d] = n_val;
  if (!p.reverse && owns_m && tid == 0) {
    p.m_states[(int64_t)bh * (sh.NC + 1) + sh.NC] = m;
    p.m_out[bh] = m;
  }
}

template <typename T, typename StateT>
cudaError_t launch(const MlstmStatesParams& p, cudaStream_t stream) {
  const dim3 grid(p.shape.BH, (p.shape.DK + 63) / 64, (p.shape.DV + 63) / 64);
  const int smem = (sizeof(T) == 2 ? 5 : 4) * tile_elems<T>() * (int)sizeof(T);
  auto kernel = mlstm_states_kernel<T, StateT>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlstm_states(DType dtype, const MlstmStatesParams& p, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kHalf: return launch<__half, float>(p, stream);
    case DType::kFloat: return launch<float, float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
