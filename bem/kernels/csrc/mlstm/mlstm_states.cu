// The mLSTM chunk-state pass: one block per (row, 64 rows of DK, 16, 32 or 64 columns of DV of the state)
// walks the chunks in sequence, keeping its tile of the state in float32 registers (mma accumulators). The walk
// is sequential, so its speed is the latency of one chunk: the gates' arithmetic is done beforehand for every
// chunk at once (mlstm_gate_scan.cu), the chunks' tiles and weights are copied two chunks ahead, and narrower
// tiles put more blocks on each multiprocessor (mlstm_state_cols picks the width from the grid).
//
// Forward, chunk c with stabiliser m (the state entering it is stored first):
//   M = max(m, pm[63]),  C <- exp(m - M) C + sum_s exp(a_s - M) k_s v_sᵀ,  n likewise with k_s,  m <- G + M
// (G the chunk's total log-forget, a_s = ĩ_s - g_s: every weight is <= 1).
// Reverse, from the last chunk back (the gradient of the state after chunk c is stored first):
//   R <- exp(G + m_c - m_{c+1}) R + sum_t exp(m_c - M_t) / √d q_t [dh_t / n_t, beta_t]ᵀ
// with the forward's stabilisers, so every weight is again <= 1.
#include "mlstm_common.cuh"

#include <cstring>

namespace bem {
namespace {

using namespace mlstm;

// An mma operand register of two 16-bit elements scaled by (wa, wb) and split into hi + lo, two 16-bit numbers
// whose sum holds the float32 products to about 16 bits, so the state (returned in float32) does not carry one
// 16-bit rounding per term.
template <typename T>
__device__ __forceinline__ void split_scaled(uint32_t in, float wa, float wb, uint32_t& hi, uint32_t& lo) {
  T e[2], h[2], l[2];
  memcpy(e, &in, sizeof(in));
  const float x0 = to_f(e[0]) * wa, x1 = to_f(e[1]) * wb;
  h[0] = tile_f<T>(x0);
  h[1] = tile_f<T>(x1);
  l[0] = tile_f<T>(x0 - to_f(h[0]));
  l[1] = tile_f<T>(x1 - to_f(h[1]));
  memcpy(&hi, h, sizeof(hi));
  memcpy(&lo, l, sizeof(lo));
}
// bfloat16: the same numbers with paired conversions (no saturation to keep: bfloat16 has float32's range).
template <>
__device__ __forceinline__ void split_scaled<__nv_bfloat16>(uint32_t in, float wa, float wb, uint32_t& hi,
                                                            uint32_t& lo) {
  __nv_bfloat162 e;
  memcpy(&e, &in, sizeof(in));
  const float2 f = __bfloat1622float2(e);
  const float2 x = make_float2(f.x * wa, f.y * wb);
  const __nv_bfloat162 h = __float22bfloat162_rn(x);
  const float2 hf = __bfloat1622float2(h);
  const __nv_bfloat162 l = __float22bfloat162_rn(make_float2(x.x - hf.x, x.y - hf.y));
  memcpy(&hi, &h, sizeof(hi));
  memcpy(&lo, &l, sizeof(lo));
}

// acc (16 rows of d from m0, 8 NT columns of dv) += sum_s w_s keys[s][m0 + .]ᵀ vals[s][.], over the chunk's 64
// tokens s: the keys tile [token][d] (stride Tile<T>::stride), the values tile [token][dv] (stride VS).
// On the tensor cores each warp scales the key operands of its own 16 rows, in registers, as hi + lo.
template <typename T, int NT, int VS>
__device__ __forceinline__ void scaled_key_mma(float (&acc)[NT][4], const T* keys, int m0, const T* vals,
                                               const float* w) {
  constexpr int S = Tile<T>::stride;
  const int lane = threadIdx.x % 32;
#ifdef BEM_MLSTM_MMA
  if constexpr (sizeof(T) == 2) {
    const int j = lane / 8, r = lane % 8, c2 = 2 * (lane % 4);
#pragma unroll
    for (int k0 = 0; k0 < 64; k0 += 16) {
      // a[0], a[1]: tokens k0 + c2, + 1 (rows m0 + lane / 4, + 8); a[2], a[3]: the same 8 tokens later
      uint32_t a[4], hi[4], lo[4];
      ldsm_x4(a, keys + (k0 + r + (j / 2) * 8) * S + m0 + (j % 2) * 8, true);
      const float w0 = w[k0 + c2], w1 = w[k0 + c2 + 1], w8 = w[k0 + c2 + 8], w9 = w[k0 + c2 + 9];
      split_scaled<T>(a[0], w0, w1, hi[0], lo[0]);
      split_scaled<T>(a[1], w0, w1, hi[1], lo[1]);
      split_scaled<T>(a[2], w8, w9, hi[2], lo[2]);
      split_scaled<T>(a[3], w8, w9, hi[3], lo[3]);
#pragma unroll
      for (int nt = 0; nt < NT; nt += 2) {
        uint32_t b[4];
        ldsm_x4(b, vals + (k0 + r + (j % 2) * 8) * VS + nt * 8 + (j / 2) * 8, true);
        mma16816<T>(acc[nt], hi, b[0], b[1]);
        mma16816<T>(acc[nt + 1], hi, b[2], b[3]);
        mma16816<T>(acc[nt], lo, b[0], b[1]);
        mma16816<T>(acc[nt + 1], lo, b[2], b[3]);
      }
    }
    return;
  }
#endif
  // float32 (and pre-sm_80) inputs on CUDA cores: keysᵀ (w ⊙ values), each weighted value rounded once
  const int g = lane / 4, c = lane % 4;
#pragma unroll 4
  for (int k = 0; k < 64; ++k) {
    const float a_lo = to_f(keys[k * S + m0 + g]);
    const float a_hi = to_f(keys[k * S + m0 + g + 8]);
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int n = nt * 8 + 2 * c;
      const float b0 = to_f(vals[k * VS + n]) * w[k], b1 = to_f(vals[k * VS + n + 1]) * w[k];
      acc[nt][0] += a_lo * b0;
      acc[nt][1] += a_lo * b1;
      acc[nt][2] += a_hi * b0;
      acc[nt][3] += a_hi * b1;
    }
  }
}

constexpr int kStages = 3;  // chunks whose tiles are in shared memory at once: this one and two ahead
constexpr int kWeightBytes = 2 * L * (int)sizeof(float);  // a chunk's weights: 64 GateT, or 64 + 64 float

// The per-chunk scalars of the walk, read two chunks ahead: forward (G, pm[63]), reverse the state's decay.
template <typename T> struct ChunkScalars {
  GateT<T> G, pm;
  float decay;
};

template <typename T>
__device__ __forceinline__ ChunkScalars<T> load_scalars(const MlstmStatesParams& p, int64_t chunk) {
  ChunkScalars<T> r{};
  if (p.reverse) {
    r.decay = p.decay[chunk];
  } else {
    const GateT<T>* gm = static_cast<const GateT<T>*>(p.chunk_gm) + chunk * 2;
    r.G = gm[0];
    r.pm = gm[1];
  }
  return r;
}

// One block per (row, 64 rows of DK, 8 NT columns of DV).
template <typename T, typename StateT, int NT>
__global__ void __launch_bounds__(kThreads) mlstm_states_kernel(const MlstmStatesParams p) {
  extern __shared__ __align__(16) unsigned char smem_raw[];
  using G = GateT<T>;
  constexpr int W = 8 * NT;                       // columns of DV a block owns
  constexpr int VS = W + 16 / (int)sizeof(T);     // padded by 16 bytes: ldmatrix's 8 rows hit 8 bank groups
  constexpr int kValElems = L * VS;
  // kStages buffers each of [token][d] keys, [token][dv] values and the chunk's weights (forward: a_tok;
  // reverse: w_tok then wn_tok): the next chunks' copies are in flight while this one's are used.
  T* keys_buf = reinterpret_cast<T*>(smem_raw);
  T* vals_buf = keys_buf + kStages * tile_elems<T>();
  unsigned char* weights_buf = reinterpret_cast<unsigned char*>(vals_buf + kStages * kValElems);
  __shared__ float w_fwd[L];  // forward: the chunk's weights exp(a_t - M)
  // n in GateT: float32 inputs carry it in double (their n_states and the gradient of n0 are held to twice
  // PyTorch's float32 error, and n sums every token's weighted key)
  __shared__ G n_part[2][64];

  const MlstmShape& sh = p.shape;
  const int bh = blockIdx.x, d0 = blockIdx.y * 64, v0 = blockIdx.z * W;
  const int warp = threadIdx.x / 32, tid = threadIdx.x;
  const bool owns_n = blockIdx.z == 0;
  const bool owns_m = blockIdx.y == 0 && blockIdx.z == 0;
  const bool pairs = sh.DV % 2 == 0;  // two adjacent state columns in one store
  const T* keys = static_cast<const T*>(p.keys) + (int64_t)bh * sh.S * sh.DK;
  const T* vals = static_cast<const T*>(p.values) + (int64_t)bh * sh.S * sh.DV;
  StateT* states = static_cast<StateT*>(p.C_states) + (int64_t)bh * sh.NC * sh.DK * sh.DV;
  const int64_t state_size = (int64_t)sh.DK * sh.DV;
  const auto chunk_at = [&](int step) { return p.reverse ? sh.NC - 1 - step : step; };

  float acc[NT][4];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + warp * 16 + acc_row(e), dv = v0 + acc_col(nt, e);
      acc[nt][e] = p.C_in != nullptr && d < sh.DK && dv < sh.DV ? p.C_in[bh * state_size + (int64_t)d * sh.DV + dv] : 0.f;
    }
  // Where this thread's accumulator pairs (rows d, columns dv and dv + 1) go in a chunk's state, set up once.
  const auto dv_of = [&](int nt) { return v0 + acc_col(nt, 0); };
  bool row_in[2], store_pairs[NT][2];
  int64_t state_at[NT][2];
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int d = d0 + warp * 16 + acc_row(2 * h);
    row_in[h] = d < sh.DK;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      state_at[nt][h] = (int64_t)d * sh.DV + dv_of(nt);
      store_pairs[nt][h] = row_in[h] && pairs && dv_of(nt) + 1 < sh.DV;
    }
  }
  const int my_d = d0 + tid;  // threads 0..63 keep n for one d each
  G n_val = 0;
  float n_decay = 0.f;
  if (owns_n && tid < 64 && p.n_in != nullptr && my_d < sh.DK) n_val = p.n_in[(int64_t)bh * sh.DK + my_d];
  float m = (!p.reverse && p.m_in != nullptr) ? p.m_in[bh] : 0.f;

  // Chunk `step`'s tiles and weights into buffer step % kStages, as one cp.async group (empty past the last
  // chunk, so that every step commits one group and the wait below counts the same). Where rows allow
  // 16-byte copies each thread copies fixed pieces of every chunk: its rows and columns are set up once here.
  constexpr int kVec = 16 / (int)sizeof(T);
  constexpr int kKeyPieces = 64 / kVec, kKeyRows = kThreads / kKeyPieces;  // pieces a row, rows a pass
  constexpr int kValPieces = W / kVec, kValRows = kThreads / kValPieces;
  const int key_row = tid / kKeyPieces, key_col = (tid % kKeyPieces) * kVec;
  const int val_row = tid / kValPieces, val_col = (tid % kValPieces) * kVec;
  const bool key_col_ok = d0 + key_col < sh.DK, val_col_ok = v0 + val_col < sh.DV;
  const T* key_src = keys + (int64_t)key_row * sh.DK + d0 + key_col;
  const T* val_src = vals + (int64_t)val_row * sh.DV + v0 + val_col;
  const auto stage_chunk = [&](int step) {
    if (step < sh.NC) {
      const int c = chunk_at(step), buf = step % kStages;
      const int64_t chunk = (int64_t)bh * sh.NC + c;
      const int rows_left = sh.S - c * L;
      T* key_dst = keys_buf + buf * tile_elems<T>();
      T* val_dst = vals_buf + buf * kValElems;
      if (sh.vec_qk) {
#pragma unroll
        for (int r = 0; r < L; r += kKeyRows) {
          const bool ok = key_col_ok && key_row + r < rows_left;
          cp_async16(key_dst + (key_row + r) * Tile<T>::stride + key_col,
                     ok ? key_src + (int64_t)(c * L + r) * sh.DK : keys, ok);
        }
      } else {
        stage_tile(key_dst, keys, sh.DK, c * L, sh.S, d0, sh.DK, false);
      }
      if (sh.vec_v) {
#pragma unroll
        for (int r = 0; r < L; r += kValRows) {
          const bool ok = val_col_ok && val_row + r < rows_left;
          cp_async16(val_dst + (val_row + r) * VS + val_col, ok ? val_src + (int64_t)(c * L + r) * sh.DV : vals, ok);
        }
      } else {
        stage_rows<W, VS>(val_dst, vals, sh.DV, c * L, sh.S, v0, sh.DV, false);
      }
      unsigned char* wb = weights_buf + buf * kWeightBytes;
      constexpr int kPieces = L * (int)sizeof(G) / 16;  // 16-byte pieces of one array of 64
      if (!p.reverse) {
        if (tid < kPieces) cp_async16(wb + 16 * tid, static_cast<const G*>(p.a_tok) + chunk * L + tid * (16 / sizeof(G)), true);
      } else if (tid < 32) {
        const float* from = (tid < 16 ? p.w_tok : p.wn_tok) + chunk * L + (tid % 16) * 4;
        cp_async16(wb + 16 * tid, from, true);
      }
    }
    cp_async_commit();
  };
  for (int step = 0; step < kStages - 1; ++step) stage_chunk(step);
  ChunkScalars<T> scalars = load_scalars<T>(p, (int64_t)bh * sh.NC + chunk_at(0)), scalars_next{};
  if (sh.NC > 1) scalars_next = load_scalars<T>(p, (int64_t)bh * sh.NC + chunk_at(1));

  for (int step = 0; step < sh.NC; ++step) {
    const int c = chunk_at(step);
    const T* keys_s = keys_buf + (step % kStages) * tile_elems<T>();
    const T* vals_s = vals_buf + (step % kStages) * kValElems;
    const unsigned char* wb = weights_buf + (step % kStages) * kWeightBytes;
    // The previous chunk's n: its two halves' partial sums (before the barrier that ended that chunk).
    if (step > 0 && owns_n && tid < 64) n_val = n_decay * n_val + n_part[0][tid] + n_part[1][tid];
    // Store the state (forward: entering chunk c; reverse: the gradient of the state after chunk c).
    StateT* out = states + (int64_t)c * state_size;
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        StateT* at = out + state_at[nt][h];
        if (store_pairs[nt][h]) {
          store2(at, from_f<StateT>(acc[nt][2 * h]), from_f<StateT>(acc[nt][2 * h + 1]));
        } else if (row_in[h]) {
          if (dv_of(nt) < sh.DV) at[0] = from_f<StateT>(acc[nt][2 * h]);
          if (dv_of(nt) + 1 < sh.DV) at[1] = from_f<StateT>(acc[nt][2 * h + 1]);
        }
      }
    if (owns_n && tid < 64 && my_d < sh.DK) {
      p.n_states[((int64_t)bh * sh.NC + c) * sh.DK + my_d] = static_cast<float>(n_val);
    }
    if (!p.reverse && owns_m && tid == 0) p.m_states[(int64_t)bh * (sh.NC + 1) + c] = m;

    stage_chunk(step + kStages - 1);
    const ChunkScalars<T> now = scalars;
    scalars = scalars_next;
    if (step + 2 < sh.NC) scalars_next = load_scalars<T>(p, (int64_t)bh * sh.NC + chunk_at(step + 2));
    cp_async_wait<kStages - 1>();  // this chunk's tiles and weights; the next chunks' stay in flight
    __syncthreads();
    const float* w_s;
    const float* wn_s;
    float decay;
    if (!p.reverse) {
      const G M = gmax(static_cast<G>(m), now.pm);
      decay = wexp<T>(m - M);
      if (tid < L) w_fwd[tid] = wexp<T>(reinterpret_cast<const G*>(wb)[tid] - M);  // 0 beyond the last token
      m = static_cast<float>(now.G + M);
      __syncthreads();
      w_s = wn_s = w_fwd;
    } else {
      decay = now.decay;
      w_s = reinterpret_cast<const float*>(wb);
      wn_s = w_s + L;
    }
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) acc[nt][e] *= decay;
    scaled_key_mma<T, NT, VS>(acc, keys_s, warp * 16, vals_s, w_s);  // + (w ⊙ keys)ᵀ values
    if (owns_n) {  // n's sum over the chunk's 64 tokens in two halves of 32, four chains each
      const int col = tid % 64, half = tid / 64;
      G sum[4] = {0, 0, 0, 0};
#pragma unroll
      for (int r = 0; r < 32; ++r) {
        const int t = half * 32 + r;
        sum[r % 4] += static_cast<G>(wn_s[t]) * to_f(keys_s[t * Tile<T>::stride + col]);
      }
      n_part[half][col] = (sum[0] + sum[1]) + (sum[2] + sum[3]);
    }
    n_decay = decay;
    __syncthreads();  // the next chunk rewrites the weights and this chunk's buffers
  }
  if (owns_n && tid < 64) n_val = n_decay * n_val + n_part[0][tid] + n_part[1][tid];

#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int d = d0 + warp * 16 + acc_row(e), dv = v0 + acc_col(nt, e);
      if (d < sh.DK && dv < sh.DV) p.C_out[bh * state_size + (int64_t)d * sh.DV + dv] = acc[nt][e];
    }
  if (owns_n && tid < 64 && my_d < sh.DK) p.n_out[(int64_t)bh * sh.DK + my_d] = static_cast<float>(n_val);
  if (!p.reverse && owns_m && tid == 0) {
    p.m_states[(int64_t)bh * (sh.NC + 1) + sh.NC] = m;
    p.m_out[bh] = m;
  }
}

template <typename T, typename StateT, int NT>
cudaError_t launch_cols(const MlstmStatesParams& p, cudaStream_t stream) {
  constexpr int W = 8 * NT;
  const dim3 grid(p.shape.BH, (p.shape.DK + 63) / 64, (p.shape.DV + W - 1) / W);
  const int smem = kStages * ((tile_elems<T>() + L * (W + 16 / (int)sizeof(T))) * (int)sizeof(T) + kWeightBytes);
  auto kernel = mlstm_states_kernel<T, StateT, NT>;
  if (smem > 48 * 1024) {
    const cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (err != cudaSuccess) return err;
  }
  kernel<<<grid, kThreads, smem, stream>>>(p);
  return cudaGetLastError();
}

template <typename T, typename StateT>
cudaError_t launch(const MlstmStatesParams& p, cudaStream_t stream) {
  switch (p.state_cols) {
    case 16: return launch_cols<T, StateT, 2>(p, stream);
    case 32: return launch_cols<T, StateT, 4>(p, stream);
    case 64: return launch_cols<T, StateT, 8>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

int mlstm_state_cols(int BH, int DK, int DV, int sms) {
  const int64_t rows = (int64_t)BH * ((DK + 63) / 64);
  for (const int cols : {64, 32}) {
    // no wider than DV needs, and at least 1.5 blocks a multiprocessor (narrower tiles repeat the keys' share
    // of the work in every block: measured on an H100, 32 columns beat 16 at 256 blocks, 16 beat 32 at 64)
    if (DV > cols / 2 && 2 * rows * ((DV + cols - 1) / cols) >= 3 * (int64_t)sms) return cols;
  }
  return 16;
}

cudaError_t launch_mlstm_states(DType dtype, const MlstmStatesParams& p, cudaStream_t stream) {
  switch (dtype) {
    case DType::kBFloat16: return launch<__nv_bfloat16, __nv_bfloat16>(p, stream);
    case DType::kHalf: return launch<__half, float>(p, stream);
    case DType::kFloat: return launch<float, float>(p, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
