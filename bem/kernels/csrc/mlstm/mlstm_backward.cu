// The mLSTM backward within chunks (all chunks at once; the gradients of the chunk states R come from the
// reverse state pass, mlstm_states.cu). With n_t, beta_t (the gradient of the stabilised denominator),
// M_t = max(m_c, pm[t]) and w_s = exp(G + a_s - m_{c+1}) (key s's weight in the state after the chunk):
//   P_ts  = (dh_t·v_s / n_t + beta_t) exp(a_s - M_t)                   (s <= t)
//   dq_t  = [ (P K)_t + exp(m_c - M_t) (C_c dh_t / n_t + beta_t n_c) ] / √d
//   dk_s  = (Pᵀ Q)_s / √d + w_s (R_c v_s + Rn_c)
//   dv_s  = sum_t (q_t·k_s / √d) exp(a_s - M_t) / n_t dh_t + w_s R_cᵀ k_s
// dq and dk: one block per (chunk, 64 columns of DK, row); dv: one per (chunk, 64 columns of DV, row).
// Each dq/dk block also writes its columns' share of q_t·dq_t and k_s·dk_s (the gates' gradients).
#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

// Per-token quantities of chunk c in shared memory: M_t, 1 / n_t, beta_t (0 beyond the last token),
// exp(m_c - M_t) and w_t.
template <typename T> struct TokenTerms {
  GateT<T> M[L];
  float inv_n[L], beta[L], inter[L], w_key[L];
};

// What token_terms reads from global memory (threads 0..63, token tid of chunk c), loaded ahead of the tiles'
// wait so that its latency hides behind theirs.
struct TokenLoads {
  float m_c, m_next, den, m_tok, beta;
};

__device__ __forceinline__ TokenLoads load_token_terms(const MlstmGradParams& p, int bh, int c) {
  const MlstmShape& sh = p.shape;
  const int tid = threadIdx.x, token = c * L + tid;
  TokenLoads r{};
  if (tid >= L) return r;
  r.m_c = p.m_states[(int64_t)bh * (sh.NC + 1) + c];
  r.m_next = p.m_states[(int64_t)bh * (sh.NC + 1) + c + 1];
  if (token < sh.S) {
    const int64_t row = (int64_t)bh * sh.S + token;
    r.den = p.den_tok[row];
    r.m_tok = p.m_tok[row];
    r.beta = p.beta[row];
  }
  return r;
}

template <typename T>
__device__ __forceinline__ void token_terms(const MlstmGradParams& p, int c, const TokenLoads& in,
                                            const GateT<T>* g_s, const GateT<T>* a_s, const GateT<T>* pm_s,
                                            TokenTerms<T>& tt) {
  const MlstmShape& sh = p.shape;
  const int tid = threadIdx.x;
  if (tid >= L) return;
  const int token = c * L + tid;
  const GateT<T> M = gmax(static_cast<GateT<T>>(in.m_c), pm_s[tid]);
  tt.M[tid] = M;
  tt.inter[tid] = wexp<T>(in.m_c - M);
  tt.w_key[tid] = wexp<T>(g_s[L - 1] + a_s[tid] - in.m_next);  // 0 beyond the last token
  if (token < sh.S) {
    tt.inv_n[tid] = wdiv<T>(1.f, normaliser<T>(in.den, in.m_tok));
    tt.beta[tid] = in.beta;
  } else {
    tt.inv_n[tid] = 0.f;
    tt.beta[tid] = 0.f;
  }
}

template <typename T, typename StateT>
__global__ void __launch_bounds__(kThreads) mlstm_grad_qk_kernel(const MlstmGradParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int ST = Tile<T>::stride;
  T* dh_s = reinterpret_cast<T*>(smem_raw);  // [token][dv]; then P [query][key]
  T* v_s = dh_s + tile_elems<T>();           // [token][dv]; then Q [token][d]
  T* c_s = v_s + tile_elems<T>();            // [d][dv] of C_c; then K [token][d]
  T* r_s = c_s + tile_elems<T>();            // [d][dv] of R (the gradient of the state after the chunk)
  T* p_s = dh_s;
  T* q_s = v_s;
  T* k_s = c_s;
  __shared__ GateT<T> g_s[L], a_s[L], pm_s[L];
  __shared__ float nc_s[64], rn_s[64];
  __shared__ TokenTerms<T> tt;

  const MlstmShape& sh = p.shape;
  const int c = blockIdx.x, d0 = blockIdx.y * 64, bh = blockIdx.z;
  const int warp = threadIdx.x / 32, tid = threadIdx.x;
  const int64_t row_base = (int64_t)bh * sh.S;
  const int64_t state_offset = ((int64_t)bh * sh.NC + c) * sh.DK * sh.DV;
  const T* dh = static_cast<const T*>(p.dh) + row_base * sh.DV;
  const T* v = static_cast<const T*>(p.v) + row_base * sh.DV;
  const StateT* C = static_cast<const StateT*>(p.C_states) + state_offset;
  const StateT* R = static_cast<const StateT*>(p.R_states) + state_offset;

  const TokenLoads token_loads = load_token_terms(p, bh, c);
  if (tid < 64) {
    const int64_t n_offset = ((int64_t)bh * sh.NC + c) * sh.DK + d0 + tid;
    nc_s[tid] = d0 + tid < sh.DK ? p.n_states[n_offset] : 0.f;
    rn_s[tid] = d0 + tid < sh.DK ? p.Rn_states[n_offset] : 0.f;
  }

  float dp[8][4], dq[8][4], dk[8][4];
  zero(dp);
  zero(dq);
  zero(dk);
  for (int v0 = 0; v0 < sh.DV; v0 += 64) {
    stage_tile(dh_s, dh, sh.DV, c * L, sh.S, v0, sh.DV, sh.vec_v);
    stage_tile(v_s, v, sh.DV, c * L, sh.S, v0, sh.DV, sh.vec_v);
    stage_tile(c_s, C, sh.DV, d0, sh.DK, v0, sh.DV, sh.vec_state);
    stage_tile(r_s, R, sh.DV, d0, sh.DK, v0, sh.DV, sh.vec_state);
    // the gates' loads wait while the tiles' copies are in flight
    if (v0 == 0) chunk_gates<T>(sh, p.igate, p.fgate, bh, c, g_s, a_s, pm_s);
    cp_async_wait_all();
    __syncthreads();
    warp_mma<T, false, false>(dp, dh_s, warp * 16, v_s);  // dH Vᵀ       (rows: queries)
    warp_mma<T, false, false>(dq, dh_s, warp * 16, c_s);  // dH C_cᵀ     (rows: queries, columns: d)
    warp_mma<T, false, false>(dk, v_s, warp * 16, r_s);   // V Rᵀ        (rows: keys, columns: d)
    __syncthreads();
  }
  // Q and K (over V's and C's tiles, free now) load while P is formed.
  const T* q = static_cast<const T*>(p.q) + row_base * sh.DK;
  const T* k = static_cast<const T*>(p.k) + row_base * sh.DK;
  stage_tile(q_s, q, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
  stage_tile(k_s, k, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
  cp_async_commit();
  token_terms<T>(p, c, token_loads, g_s, a_s, pm_s, tt);
  __syncthreads();

  // P into shared memory (over dH's tile); dq and dk start from the chunk states' shares.
  // float16: P can pass float16's range (1 / n_t of 1e5 and more where a denominator nearly cancels under
  // extreme gates); saturated, its products P K and Pᵀ Q no longer match each other's share of q_t·dq_t and
  // k_s·dk_s, whose difference the forget gate's gradient sums. So P goes in scaled by a power of two that
  // brings its largest element below 2^15, and dq and dk take that scale back, exactly. 1 wherever P fits
  // (every ordinary input), so those results do not change.
  constexpr bool kScaleP = std::is_same<T, __half>::value;
  float p_max = 0.f;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + acc_row(e), col = acc_col(nt, e);
      const float w = col <= row ? (dp[nt][e] * tt.inv_n[row] + tt.beta[row]) * wexp<T>(a_s[col] - tt.M[row]) : 0.f;
      if (kScaleP) {
        dp[nt][e] = w;
        p_max = fmaxf(p_max, fabsf(w));
      } else {
        p_s[row * ST + col] = tile_f<T>(w);
      }
      dq[nt][e] = tt.inter[row] * (dq[nt][e] * tt.inv_n[row] + tt.beta[row] * nc_s[col]);
      dk[nt][e] = wdiv<T>(tt.w_key[row] * (dk[nt][e] + rn_s[col]), sh.scale);
    }
  float p_scale = 1.f;
  if (kScaleP) {
    __shared__ float warp_max[kThreads / 32];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) p_max = fmaxf(p_max, __shfl_xor_sync(0xffffffffu, p_max, o));
    if (tid % 32 == 0) warp_max[warp] = p_max;
    __syncthreads();
#pragma unroll
    for (int w = 0; w < kThreads / 32; ++w) p_max = fmaxf(p_max, warp_max[w]);
    int exponent = 0;
    frexpf(p_max, &exponent);  // p_max < 2^exponent
    if (p_max <= 3.0e38f && exponent > 15) p_scale = ldexpf(1.f, 15 - exponent);
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        p_s[(warp * 16 + acc_row(e)) * ST + acc_col(nt, e)] = tile_f<T>(dp[nt][e] * p_scale);
        dq[nt][e] *= p_scale;
        dk[nt][e] *= p_scale;
      }
  }
  cp_async_wait_all();
  __syncthreads();
  warp_mma<T, false, true>(dq, p_s, warp * 16, k_s);  // + P K
  warp_mma<T, true, true>(dk, p_s, warp * 16, q_s);   // + Pᵀ Q
  if (kScaleP && p_scale != 1.f) {
    const float undo = 1.f / p_scale;  // a power of two: exact
#pragma unroll
    for (int nt = 0; nt < 8; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        dq[nt][e] *= undo;
        dk[nt][e] *= undo;
      }
  }

  T* dq_out = static_cast<T*>(p.dq) + row_base * sh.DK;
  T* dk_out = static_cast<T*>(p.dk) + row_base * sh.DK;
  float qdq[2] = {0.f, 0.f}, kdk[2] = {0.f, 0.f};
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + acc_row(e), col = acc_col(nt, e), token = c * L + row, d = d0 + col;
      const float dq_v = dq[nt][e] * sh.scale, dk_v = dk[nt][e] * sh.scale;
      qdq[e / 2] += to_f(q_s[row * ST + col]) * dq_v;
      kdk[e / 2] += to_f(k_s[row * ST + col]) * dk_v;
      if (token < sh.S && d < sh.DK) {
        dq_out[(int64_t)token * sh.DK + d] = from_f<T>(dq_v);
        dk_out[(int64_t)token * sh.DK + d] = from_f<T>(dk_v);
      }
    }
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    qdq[hi] += __shfl_xor_sync(0xffffffffu, qdq[hi], 1);
    qdq[hi] += __shfl_xor_sync(0xffffffffu, qdq[hi], 2);
    kdk[hi] += __shfl_xor_sync(0xffffffffu, kdk[hi], 1);
    kdk[hi] += __shfl_xor_sync(0xffffffffu, kdk[hi], 2);
    const int token = c * L + warp * 16 + acc_row(2 * hi);
    if (tid % 4 == 0 && token < sh.S) {
      const int64_t out = ((int64_t)blockIdx.y * sh.BH + bh) * sh.S + token;
      p.qdq[out] = qdq[hi];
      p.kdk[out] = kdk[hi];
    }
  }
}

template <typename T, typename StateT>
__global__ void __launch_bounds__(kThreads) mlstm_grad_v_kernel(const MlstmGradParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int ST = Tile<T>::stride;
  T* q_s = reinterpret_cast<T*>(smem_raw);  // [token][d]; then the weights [query][key]
  T* k_s = q_s + tile_elems<T>();           // [token][d]; then dH [token][dv]
  T* r_s = k_s + tile_elems<T>();           // [d][dv] of R (the gradient of the state after the chunk)
  T* w_s = q_s;
  T* dh_s = k_s;
  __shared__ GateT<T> g_s[L], a_s[L], pm_s[L];
  __shared__ TokenTerms<T> tt;

  const MlstmShape& sh = p.shape;
  const int c = blockIdx.x, v0 = blockIdx.y * 64, bh = blockIdx.z;
  const int warp = threadIdx.x / 32;
  const int64_t row_base = (int64_t)bh * sh.S;
  const T* q = static_cast<const T*>(p.q) + row_base * sh.DK;
  const T* k = static_cast<const T*>(p.k) + row_base * sh.DK;
  const StateT* R = static_cast<const StateT*>(p.R_states) + ((int64_t)bh * sh.NC + c) * sh.DK * sh.DV;

  const TokenLoads token_loads = load_token_terms(p, bh, c);
  float s_acc[8][4], dv[8][4];
  zero(s_acc);
  zero(dv);
  for (int d0 = 0; d0 < sh.DK; d0 += 64) {
    stage_tile(q_s, q, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
    stage_tile(k_s, k, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
    stage_tile(r_s, R, sh.DV, d0, sh.DK, v0, sh.DV, sh.vec_state);
    // the gates' loads wait while the tiles' copies are in flight
    if (d0 == 0) chunk_gates<T>(sh, p.igate, p.fgate, bh, c, g_s, a_s, pm_s);
    cp_async_wait_all();
    __syncthreads();
    warp_mma<T, false, false>(s_acc, q_s, warp * 16, k_s);  // Q Kᵀ   (rows: queries)
    warp_mma<T, false, true>(dv, k_s, warp * 16, r_s);      // K R    (rows: keys)
    __syncthreads();
  }
  // dH (over K's tile, free now) loads while the weights are formed.
  const T* dh = static_cast<const T*>(p.dh) + row_base * sh.DV;
  stage_tile(dh_s, dh, sh.DV, c * L, sh.S, v0, sh.DV, sh.vec_v);
  cp_async_commit();
  token_terms<T>(p, c, token_loads, g_s, a_s, pm_s, tt);
  __syncthreads();
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = warp * 16 + acc_row(e), col = acc_col(nt, e);
      const float w = col <= row ? s_acc[nt][e] * sh.scale * wexp<T>(a_s[col] - tt.M[row]) * tt.inv_n[row] : 0.f;
      w_s[row * ST + col] = tile_f<T>(w);
      dv[nt][e] *= tt.w_key[row];
    }
  cp_async_wait_all();
  __syncthreads();
  warp_mma<T, true, true>(dv, w_s, warp * 16, dh_s);  // + Wᵀ dH

  T* dv_out = static_cast<T*>(p.dv) + row_base * sh.DV;
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int token = c * L + warp * 16 + acc_row(e), col = v0 + acc_col(nt, e);
      if (token < sh.S && col < sh.DV) dv_out[(int64_t)token * sh.DV + col] = from_f<T>(dv[nt][e]);
    }
}

template <typename Kernel>
cudaError_t launch_one(Kernel kernel, dim3 grid, int smem, const MlstmGradParams& p, cudaStream_t stream) {
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename StateT>
cudaError_t launch(const MlstmGradParams& p, cudaStream_t stream) {
  const MlstmShape& sh = p.shape;
  const int tile_bytes = tile_elems<T>() * (int)sizeof(T);
  cudaError_t err = launch_one(mlstm_grad_qk_kernel<T, StateT>, dim3(sh.NC, (sh.DK + 63) / 64, sh.BH),
                               4 * tile_bytes, p, stream);
  if (err != cudaSuccess) return err;
  return launch_one(mlstm_grad_v_kernel<T, StateT>, dim3(sh.NC, (sh.DV + 63) / 64, sh.BH), 3 * tile_bytes, p,
                    stream);
}

}  // namespace

cudaError_t launch_mlstm_grads(DType dtype, const MlstmGradParams& p, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kHalf: return launch<__half, float>(p, stream);
    case DType::kFloat: return launch<float, float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
