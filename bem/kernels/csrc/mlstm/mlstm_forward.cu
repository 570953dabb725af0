// The mLSTM outputs, chunk by chunk (all chunks at once): one block per (chunk c, 64 columns of h, row) of
// 4 warps, each warp 16 queries. With the state (C_c, n_c, m_c) entering the chunk (mlstm_states.cu) and
// M_t = max(m_c, pm[t]) (mlstm_common.cuh, chunk_gates):
//   P_ts = (q_t·k_s) / √d · exp(a_s - M_t)  (s <= t)           the chunk's own keys, weights <= 1
//   num_t = (P V)_t + exp(m_c - M_t) / √d · C_cᵀ q_t,   den_t = sum_s P_ts + exp(m_c - M_t) / √d · n_c·q_t
//   h_t = num_t / max(|den_t|, exp(-m_t)),   m_t = g[t] + M_t
// Q Kᵀ and Q C_c accumulate over DK in 64-column steps; P goes through shared memory into P V.
#include <cstdint>
#include <cstring>

#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

// Two phases, so that the block computes while its later tiles arrive and its two accumulators are never live
// at once: Q Kᵀ (and q·n) over DK with C's first rows and V in flight, then P; then Q C_c over DK and P V.
// 16-bit inputs: at most 128 registers, so that four blocks fit on a multiprocessor (the kernel waits on
// memory).
template <typename T, typename StateT>
__global__ void __launch_bounds__(kThreads, sizeof(T) == 2 ? 4 : 1) mlstm_outputs_kernel(const MlstmOutputsParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  constexpr int ST = Tile<T>::stride;
  T* q_s = reinterpret_cast<T*>(smem_raw);  // [token][d]
  T* k_s = q_s + tile_elems<T>();           // [token][d]; then P [query][key]
  T* c_s = k_s + tile_elems<T>();           // [d][dv] of C_c
  T* v_s = c_s + tile_elems<T>();           // [token][dv]
  T* p_s = k_s;
  __shared__ GateT<T> g_s[L], a_s[L], pm_s[L];
  __shared__ float n_s[64], qn_s[L];

  const MlstmShape& sh = p.shape;
  const int c = blockIdx.x, v0 = blockIdx.y * 64, bh = blockIdx.z;
  const int warp = threadIdx.x / 32, tid = threadIdx.x;
  const int64_t row_base = (int64_t)bh * sh.S;
  const T* q = static_cast<const T*>(p.q) + row_base * sh.DK;
  const T* k = static_cast<const T*>(p.k) + row_base * sh.DK;
  const T* v = static_cast<const T*>(p.v) + row_base * sh.DV;
  const StateT* C = static_cast<const StateT*>(p.C_states) + ((int64_t)bh * sh.NC + c) * sh.DK * sh.DV;
  const float* n_c = p.n_states + ((int64_t)bh * sh.NC + c) * sh.DK;
  const float m_c = p.m_states[(int64_t)bh * (sh.NC + 1) + c];
  const bool one_tile = sh.DK <= 64;  // Q's tile then serves both phases

  // Phase 1: S = Q Kᵀ and q_t·n_c, in GateT (float32 inputs sum it in double, as they form their log weights:
  // the denominator it enters can cancel, and the float32 backward's error bound is tight).
  float s_acc[8][4];
  zero(s_acc);
  GateT<T> qn = 0;  // over half a row (t = tid / 2)
  for (int d0 = 0; d0 < sh.DK; d0 += 64) {
    stage_tile(q_s, q, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
    stage_tile(k_s, k, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
    cp_async_commit();
    if (d0 == 0) {  // phase 2's first tiles, in flight through phase 1
      stage_tile(c_s, C, sh.DV, 0, sh.DK, v0, sh.DV, sh.vec_state);
      stage_tile(v_s, v, sh.DV, c * L, sh.S, v0, sh.DV, sh.vec_v);
      cp_async_commit();
      chunk_gates<T>(sh, p.igate, p.fgate, bh, c, g_s, a_s, pm_s);  // its loads wait while the copies fly
    }
    if (tid < 64) n_s[tid] = d0 + tid < sh.DK ? n_c[d0 + tid] : 0.f;
    if (d0 == 0) {
      cp_async_wait<1>();  // Q and K; C and V may still be in flight
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    warp_mma<T, false, false>(s_acc, q_s, warp * 16, k_s);  // Q Kᵀ
    const int half = tid % 2;
    GateT<T> part[4] = {0, 0, 0, 0};  // four chains, not one of 32
#pragma unroll
    for (int j = 0; j < 32; ++j) {
      part[j % 4] += static_cast<GateT<T>>(to_f(q_s[(tid / 2) * ST + half * 32 + j])) * n_s[half * 32 + j];
    }
    qn += (part[0] + part[1]) + (part[2] + part[3]);
    __syncthreads();
  }
  qn += __shfl_xor_sync(0xffffffffu, qn, 1);
  if (tid % 2 == 0) qn_s[tid / 2] = static_cast<float>(qn);

  // P = (Q Kᵀ / √d) ⊙ exp(a_s - M_t), causal, into shared memory (over K's tile); its row sums in float32.
  float row_sum[2] = {0.f, 0.f}, inter[2];
  GateT<T> M[2];
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int t = warp * 16 + acc_row(2 * hi);
    M[hi] = gmax(static_cast<GateT<T>>(m_c), pm_s[t]);
    inter[hi] = wexp<T>(m_c - M[hi]) * sh.scale;
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int hi = 0; hi < 2; ++hi) {
      const int t = warp * 16 + acc_row(2 * hi), s0 = acc_col(nt, 0);
      float w[2];
#pragma unroll
      for (int j = 0; j < 2; ++j) {
        const int s = s0 + j;
        w[j] = s <= t ? s_acc[nt][2 * hi + j] * sh.scale * wexp<T>(a_s[s] - M[hi]) : 0.f;
        row_sum[hi] += w[j];
      }
      store2(p_s + t * ST + s0, tile_f<T>(w[0]), tile_f<T>(w[1]));
    }
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 1);
    row_sum[hi] += __shfl_xor_sync(0xffffffffu, row_sum[hi], 2);
  }

  // Phase 2: Q C_c over DK, scaled, then + P V.
  float h_acc[8][4];
  zero(h_acc);
  for (int d0 = 0; d0 < sh.DK; d0 += 64) {
    if (!one_tile) {
      __syncthreads();  // the previous tiles are read
      stage_tile(q_s, q, sh.DK, c * L, sh.S, d0, sh.DK, sh.vec_qk);
      if (d0 > 0) stage_tile(c_s, C, sh.DV, d0, sh.DK, v0, sh.DV, sh.vec_state);
    }
    cp_async_wait_all();
    __syncthreads();
    warp_mma<T, false, true>(h_acc, q_s, warp * 16, c_s);  // Q C_c
  }
#pragma unroll
  for (int nt = 0; nt < 8; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) h_acc[nt][e] *= inter[e / 2];
  warp_mma<T, false, true>(h_acc, p_s, warp * 16, v_s);  // + P V

  T* h = static_cast<T*>(p.h) + row_base * sh.DV;
  const bool pairs = sh.DV % 2 == 0;
#pragma unroll
  for (int hi = 0; hi < 2; ++hi) {
    const int t = warp * 16 + acc_row(2 * hi), token = c * L + t;
    const float den = inter[hi] * qn_s[t] + row_sum[hi];
    const float m_t = static_cast<float>(g_s[t] + M[hi]);
    const float inv_n = wdiv<T>(1.f, normaliser<T>(den, m_t));
    if (token < sh.S) {
#pragma unroll
      for (int nt = 0; nt < 8; ++nt) {
        const int dv = v0 + acc_col(nt, 0);
        T* at = h + (int64_t)token * sh.DV + dv;
        const T x = from_f<T>(h_acc[nt][2 * hi] * inv_n), y = from_f<T>(h_acc[nt][2 * hi + 1] * inv_n);
        if (pairs && dv + 1 < sh.DV) {
          store2(at, x, y);
        } else {
          if (dv < sh.DV) at[0] = x;
          if (dv + 1 < sh.DV) at[1] = y;
        }
      }
      if (blockIdx.y == 0 && tid % 4 == 0 && p.m_tok != nullptr) {
        p.m_tok[row_base + token] = m_t;
        p.den_tok[row_base + token] = den;
      }
    }
  }
}

template <typename T, typename StateT>
cudaError_t launch(const MlstmOutputsParams& p, cudaStream_t stream) {
  const dim3 grid(p.shape.NC, (p.shape.DV + 63) / 64, p.shape.BH);
  const int smem = 4 * tile_elems<T>() * (int)sizeof(T);
  auto kernel = mlstm_outputs_kernel<T, StateT>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlstm_outputs(DType dtype, const MlstmOutputsParams& p, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kHalf: return launch<__half, float>(p, stream);
    case DType::kFloat: return launch<float, float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
