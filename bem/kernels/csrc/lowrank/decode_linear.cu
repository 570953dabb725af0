// The BEM linear at decode sizes (M <= 64 tokens) in one launch that reads W once:
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// Tokens are few, so the tile is transposed ("swap AB"): each block computes Y^T for 128 rows of W
// against all tokens (padded to 16/32/64) on the tensor cores. V^T rides along as extra rows of the
// same operand, so X V accumulates in the same K loop. The update is linear in X V, so each split of
// K can add its partial s * ((X V)_part ⊙ c) U^T to its partial result; the last block of a tile to
// finish (counted in a device-side counter that it resets) sums the splits in a fixed order and adds
// the bias. Tile column 0 also reduces X V itself, which the backward reuses.
#include "../common/common.cuh"
#include "launchers.h"

namespace bem {
namespace {

using namespace nvcuda;

constexpr int kBN = kDecodeTileN, kBK = 32, kStages = 4, kThreads = 256;
static_assert(kBN == 16 * (kThreads / 32), "one 16-row group of W per warp");

// Split-K arrival counters, one per 128-column tile; each tile's last block sets its counter back to 0.
__device__ unsigned int g_tile_arrivals[kMaxDecodeTiles];

template <int MT, int RT, bool WT> struct DecodeLayout {
  static constexpr int MP = MT * 16, RP = RT * 16;
  static constexpr int a_ld = WT ? kBN + kPad : kBK + kPad;
  static constexpr int a_bytes = round_up((WT ? kBK : kBN) * a_ld * 2, 128);
  static constexpr int v_ld = RP + kPad;
  static constexpr int v_bytes = round_up(kBK * v_ld * 2, 128);
  static constexpr int x_ld = kBK + kPad;
  static constexpr int x_bytes = round_up(MP * x_ld * 2, 128);
  static constexpr int stage_bytes = a_bytes + v_bytes + x_bytes;
  static constexpr int z_ld = MP + 4;
  static constexpr int z_bytes = round_up(RP * z_ld * 4, 128);
  static constexpr int b2_ld = MP + kPad;
  static constexpr int b2_half = round_up(RP * b2_ld * 2, 128);  // one part of s (X V) ⊙ c
  static constexpr int b2_bytes = 2 * b2_half;                      // its high and low parts
  static constexpr int u_ld = RP + kPad;
  static constexpr int u_bytes = round_up(kBN * u_ld * 2, 128);
  static constexpr int y_ld = kBN + 4;
  static constexpr int y_bytes = round_up(MP * y_ld * 4, 128);
  static constexpr int epi_bytes = z_bytes + b2_bytes + u_bytes + y_bytes;
  static constexpr int total_bytes = cmax(kStages * stage_bytes, epi_bytes);
};

struct DecodeFlags {
  bool w_vec, v_vec, x_vec;
};

template <typename T, int MT, int RT, bool WT>
__global__ void __launch_bounds__(kThreads) decode_linear_kernel(DecodeArgs p, DecodeFlags f) {
  using Lay = DecodeLayout<MT, RT, WT>;
  constexpr int MP = Lay::MP, RP = Lay::RP;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ bool s_last;
  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* V = static_cast<const T*>(p.V);
  const T* U = static_cast<const T*>(p.U);
  const T* codes = static_cast<const T*>(p.codes);
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const T zero = from_acc<T>(0.f);
  const int tid = threadIdx.x, warp = tid / 32;
  const int tile = blockIdx.x, split = blockIdx.y, n0 = tile * kBN;
  const int k_begin = split * p.k_per_split;
  const int k_end = min(K, k_begin + p.k_per_split);

  for (int i = tid; i < kStages * Lay::stage_bytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  auto stage_w = [&](int s) { return reinterpret_cast<T*>(smem + s * Lay::stage_bytes); };
  auto stage_v = [&](int s) { return reinterpret_cast<T*>(smem + s * Lay::stage_bytes + Lay::a_bytes); };
  auto stage_x = [&](int s) {
    return reinterpret_cast<T*>(smem + s * Lay::stage_bytes + Lay::a_bytes + Lay::v_bytes);
  };

  auto load_stage = [&](int s, int k0) {
    T* ws = stage_w(s);
    T* vs = stage_v(s);
    T* xs = stage_x(s);
    if constexpr (!WT) {  // W row-major N x K: the tile is 128 rows of n, 32 columns of k
      if (f.w_vec) {
        for (int i = tid; i < kBN * kBK / 8; i += kThreads) {
          const int row = i / (kBK / 8), col = (i % (kBK / 8)) * 8;
          const bool ok = n0 + row < N && k0 + col < k_end;
          cp_async16(ws + row * Lay::a_ld + col, ok ? W + (size_t)(n0 + row) * K + k0 + col : W, ok);
        }
      } else {
        for (int i = tid; i < kBN * kBK; i += kThreads) {
          const int row = i / kBK, col = i % kBK;
          const bool ok = n0 + row < N && k0 + col < k_end;
          ws[row * Lay::a_ld + col] = ok ? W[(size_t)(n0 + row) * K + k0 + col] : zero;
        }
      }
    } else {  // W is the transpose of a row-major K x N buffer: the tile is 32 rows of k, 128 of n
      if (f.w_vec) {
        for (int i = tid; i < kBK * kBN / 8; i += kThreads) {
          const int row = i / (kBN / 8), col = (i % (kBN / 8)) * 8;
          const bool ok = k0 + row < k_end && n0 + col < N;
          cp_async16(ws + row * Lay::a_ld + col, ok ? W + (size_t)(k0 + row) * N + n0 + col : W, ok);
        }
      } else {
        for (int i = tid; i < kBK * kBN; i += kThreads) {
          const int row = i / kBN, col = i % kBN;
          const bool ok = k0 + row < k_end && n0 + col < N;
          ws[row * Lay::a_ld + col] = ok ? W[(size_t)(k0 + row) * N + n0 + col] : zero;
        }
      }
    }
    if (f.v_vec) {
      const int vpr = r / 8;
      for (int i = tid; i < kBK * vpr; i += kThreads) {
        const int row = i / vpr, col = (i % vpr) * 8;
        const bool ok = k0 + row < k_end;
        cp_async16(vs + row * Lay::v_ld + col, ok ? V + (size_t)(k0 + row) * r + col : V, ok);
      }
    } else {
      for (int i = tid; i < kBK * RP; i += kThreads) {
        const int row = i / RP, col = i % RP;
        vs[row * Lay::v_ld + col] = (k0 + row < k_end && col < r) ? V[(size_t)(k0 + row) * r + col] : zero;
      }
    }
    if (f.x_vec) {
      for (int i = tid; i < MP * kBK / 8; i += kThreads) {
        const int row = i / (kBK / 8), col = (i % (kBK / 8)) * 8;
        const bool ok = row < M && k0 + col < k_end;
        cp_async16(xs + row * Lay::x_ld + col, ok ? X + (size_t)row * K + k0 + col : X, ok);
      }
    } else {
      for (int i = tid; i < MP * kBK; i += kThreads) {
        const int row = i / kBK, col = i % kBK;
        xs[row * Lay::x_ld + col] = (row < M && k0 + col < k_end) ? X[(size_t)row * K + k0 + col] : zero;
      }
    }
  };

  using ALayout = typename std::conditional<WT, wmma::col_major, wmma::row_major>::type;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[MT], acc_v[MT];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    wmma::fill_fragment(acc[mt], 0.f);
    wmma::fill_fragment(acc_v[mt], 0.f);
  }
  const bool owns_v = warp < RT;  // warp w also computes rows [16w, 16w + 16) of (X V)^T

  const int ksteps = (k_end - k_begin + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ksteps) load_stage(s, k_begin + s * kBK);
    cp_async_commit();
  }
  for (int kt = 0; kt < ksteps; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < ksteps) load_stage(next % kStages, k_begin + next * kBK);
    cp_async_commit();
    const T* ws = stage_w(kt % kStages);
    const T* vs = stage_v(kt % kStages);
    const T* xs = stage_x(kt % kStages);
#pragma unroll
    for (int kk = 0; kk < kBK / 16; ++kk) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[MT];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) wmma::load_matrix_sync(b[mt], xs + mt * 16 * Lay::x_ld + kk * 16, Lay::x_ld);
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, ALayout> a;
      if constexpr (WT) {
        wmma::load_matrix_sync(a, ws + kk * 16 * Lay::a_ld + warp * 16, Lay::a_ld);
      } else {
        wmma::load_matrix_sync(a, ws + warp * 16 * Lay::a_ld + kk * 16, Lay::a_ld);
      }
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) wmma::mma_sync(acc[mt], a, b[mt], acc[mt]);
      if (owns_v) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> av;
        wmma::load_matrix_sync(av, vs + kk * 16 * Lay::v_ld + warp * 16, Lay::v_ld);
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) wmma::mma_sync(acc_v[mt], av, b[mt], acc_v[mt]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Epilogue: (X V)^T partial -> zs; s * zs ⊙ c^T -> b2 (as T); U tile -> us; acc += us · b2.
  float* zs = reinterpret_cast<float*>(smem);
  T* b2 = reinterpret_cast<T*>(smem + Lay::z_bytes);
  T* b2_low = reinterpret_cast<T*>(smem + Lay::z_bytes + Lay::b2_half);
  T* us = reinterpret_cast<T*>(smem + Lay::z_bytes + Lay::b2_bytes);
  float* ys = reinterpret_cast<float*>(smem + Lay::z_bytes + Lay::b2_bytes + Lay::u_bytes);
  if (owns_v) {
#pragma unroll
    for (int mt = 0; mt < MT; ++mt)
      wmma::store_matrix_sync(zs + warp * 16 * Lay::z_ld + mt * 16, acc_v[mt], Lay::z_ld, wmma::mem_row_major);
  }
  for (int i = tid; i < kBN * RP; i += kThreads) {
    const int row = i / RP, col = i % RP;
    us[row * Lay::u_ld + col] = (n0 + row < N && col < r) ? U[(size_t)(n0 + row) * r + col] : zero;
  }
  __syncthreads();
  const bool partial = gridDim.y > 1;
  for (int i = tid; i < RP * MP; i += kThreads) {
    const int j = i / MP, m = i % MP;
    const float z = zs[j * Lay::z_ld + m];
    const bool valid = m < M && j < r;
    const float c = valid ? (codes ? to_acc(codes[(size_t)m * r + j]) : 1.f) : 0.f;
    // High and low parts (to 16 bits of mantissa): with K split, z is a partial sum, and rounding each
    // split's partial to T alone added one rounding a split to the update.
    const float coef = p.scale * z * c;
    const T high = from_acc<T>(coef);
    b2[j * Lay::b2_ld + m] = high;
    b2_low[j * Lay::b2_ld + m] = from_acc<T>(coef - to_acc(high));
    if (tile == 0 && valid && p.P) {  // P (x V, for the backward) is skipped at inference
      if (partial) p.ws_p[((size_t)split * M + m) * r + j] = z;
      else p.P[(size_t)m * r + j] = z;
    }
  }
  __syncthreads();
#pragma unroll
  for (int t = 0; t < RT; ++t) {
    wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
    wmma::load_matrix_sync(a, us + warp * 16 * Lay::u_ld + t * 16, Lay::u_ld);
#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
      wmma::load_matrix_sync(b, b2_low + t * 16 * Lay::b2_ld + mt * 16, Lay::b2_ld);
      wmma::mma_sync(acc[mt], a, b, acc[mt]);
      wmma::load_matrix_sync(b, b2 + t * 16 * Lay::b2_ld + mt * 16, Lay::b2_ld);
      wmma::mma_sync(acc[mt], a, b, acc[mt]);
    }
  }
  // acc holds Y^T (n x m); store it transposed so ys is Y's row-major tile.
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
    wmma::store_matrix_sync(ys + mt * 16 * Lay::y_ld + warp * 16, acc[mt], Lay::y_ld, wmma::mem_col_major);
  __syncthreads();

  if (!partial) {
    for (int i = tid; i < M * kBN; i += kThreads) {
      const int m = i / kBN, n = i % kBN, gn = n0 + n;
      if (gn >= N) continue;
      float v = ys[m * Lay::y_ld + n];
      if (bias) v += to_acc(bias[gn]);
      Y[(size_t)m * N + gn] = from_acc<T>(v);
    }
    return;
  }

  for (int i = tid; i < M * kBN; i += kThreads) {
    const int m = i / kBN, n = i % kBN, gn = n0 + n;
    if (gn < N) p.ws[((size_t)split * M + m) * N + gn] = ys[m * Lay::y_ld + n];
  }
  __threadfence();
  __syncthreads();
  if (tid == 0) s_last = atomicAdd(&g_tile_arrivals[tile], 1u) == gridDim.y - 1;
  __syncthreads();
  if (!s_last) return;
  __threadfence();
  // Last block of this tile: sum the splits in split order, so the result does not depend on timing.
  for (int i = tid; i < M * kBN; i += kThreads) {
    const int m = i / kBN, n = i % kBN, gn = n0 + n;
    if (gn >= N) continue;
    float v = 0.f;
    for (int s = 0; s < (int)gridDim.y; ++s) v += __ldcg(p.ws + ((size_t)s * M + m) * N + gn);
    if (bias) v += to_acc(bias[gn]);
    Y[(size_t)m * N + gn] = from_acc<T>(v);
  }
  if (tile == 0 && p.P) {
    for (int i = tid; i < M * r; i += kThreads) {
      float z = 0.f;
      for (int s = 0; s < (int)gridDim.y; ++s) z += __ldcg(p.ws_p + (size_t)s * M * r + i);
      p.P[i] = z;
    }
  }
  if (tid == 0) g_tile_arrivals[tile] = 0;
}


template <typename T, int MT, int RT, bool WT>
cudaError_t launch_typed(const DecodeArgs& a, cudaStream_t stream) {
  using Lay = DecodeLayout<MT, RT, WT>;
  auto kernel = decode_linear_kernel<T, MT, RT, WT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Lay::total_bytes);
  if (err != cudaSuccess) return err;
  DecodeFlags f;
  f.w_vec = (WT ? a.N % 8 == 0 : a.K % 8 == 0) && aligned16(a.W) && a.k_per_split % 8 == 0;
  f.v_vec = a.r % 8 == 0 && aligned16(a.V);
  f.x_vec = a.K % 8 == 0 && aligned16(a.X) && a.k_per_split % 8 == 0;
  const dim3 grid((a.N + kBN - 1) / kBN, a.split_k);
  kernel<<<grid, kThreads, Lay::total_bytes, stream>>>(a, f);
  return cudaGetLastError();
}

template <typename T, int MT, bool WT>
cudaError_t launch_rank(const DecodeArgs& a, cudaStream_t stream) {
  if (a.r <= 16) return launch_typed<T, MT, 1, WT>(a, stream);
  if (a.r <= 32) return launch_typed<T, MT, 2, WT>(a, stream);
  if (a.r <= 64) return launch_typed<T, MT, 4, WT>(a, stream);
  if (a.r <= kMaxFusedRank) return launch_typed<T, MT, 8, WT>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T, bool WT>
cudaError_t launch_tokens(const DecodeArgs& a, cudaStream_t stream) {
  if (a.M <= 16) return launch_rank<T, 1, WT>(a, stream);
  if (a.M <= 32) return launch_rank<T, 2, WT>(a, stream);
  if (a.M <= kDecodeMaxTokens) return launch_rank<T, 4, WT>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_layout(const DecodeArgs& a, cudaStream_t stream) {
  return a.w_transposed ? launch_tokens<T, true>(a, stream) : launch_tokens<T, false>(a, stream);
}

template <int MT, int RT, bool WT> int smem_bytes() { return DecodeLayout<MT, RT, WT>::total_bytes; }

template <int MT, bool WT> int smem_bytes_rank(int r) {
  return r <= 16 ? smem_bytes<MT, 1, WT>() : r <= 32 ? smem_bytes<MT, 2, WT>()
         : r <= 64 ? smem_bytes<MT, 4, WT>() : smem_bytes<MT, 8, WT>();
}

template <bool WT> int smem_bytes_tokens(int M, int r) {
  return M <= 16 ? smem_bytes_rank<1, WT>(r) : M <= 32 ? smem_bytes_rank<2, WT>(r) : smem_bytes_rank<4, WT>(r);
}

}  // namespace

int decode_split_k(int M, int N, int K, int r, bool w_transposed, int num_sms, int requested) {
  const int tiles = (N + kBN - 1) / kBN;
  const int ksteps = (K + kBK - 1) / kBK;
  // Resident blocks per multiprocessor: 128 registers x 256 threads allow 2; shared memory may allow fewer.
  const int smem = w_transposed ? smem_bytes_tokens<true>(M, r) : smem_bytes_tokens<false>(M, r);
  int per_sm = (227 * 1024) / (smem + 1024);
  per_sm = per_sm < 1 ? 1 : (per_sm > 2 ? 2 : per_sm);
  // One full wave: as many splits as fit beside the tiles (a second, partial wave would cost a whole one).
  const int max_split = (ksteps + 3) / 4;  // at least 4 K steps (128 columns) per split
  int split = requested > 0 ? requested : (per_sm * num_sms) / tiles;
  split = split < 1 ? 1 : (split > max_split ? max_split : split);
  if (split > 64) split = 64;
  const int per = decode_k_per_split(K, split);
  return (K + per - 1) / per;  // no empty splits
}

int decode_k_per_split(int K, int split_k) {
  const int ksteps = (K + kBK - 1) / kBK;
  return (ksteps + split_k - 1) / split_k * kBK;
}

cudaError_t launch_decode_linear(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.M < 1 || args.M > kDecodeMaxTokens || (args.N + kBN - 1) / kBN > kMaxDecodeTiles)
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_layout<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
