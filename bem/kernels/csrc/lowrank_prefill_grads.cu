// The prefill backward's low-rank pieces in two launches (launchers.h, PrefillGradArgs):
//
//     P = X V,  G = dY U,  low = s G ⊙ c,  pc = s P ⊙ c,  dcodes = s G ⊙ P,  dV = X^T low,  dU = dY^T pc
//
// In a small model's training step every wrapped linear's backward is bound by host time, and composed these
// were two cuBLAS projections, the coefficient kernel and two split-K cuBLAS GEMMs with their reduction kernels:
// five library calls and seven or more launches a layer. Here:
// - the coefficient kernel: a block owns 16 MT rows; its 8 warps split K (then N) into runs and project them on
//   the tensor cores (lowrank_project.cuh), the warps' shares of P and then G meet in shared memory and are summed
//   in a fixed order, and the coefficients are written in the dtype, rounded as the composed backward rounds them
//   (P and G never reach memory);
// - the weight-gradient kernel: a block owns a tile of columns of X (for dV) or dY (for dU) over a run of rows; a
//   thread keeps an 8- or 4-column slice of the tile against all r ranks in fp32 registers, reading its rows with
//   8- or 16-byte loads and the rows' coefficients through L1. Runs of rows are split over blocks to fill the GPU;
//   their fp32 partials go to a workspace, and the last block of a tile (a counter the coefficient kernel zeroed)
//   sums them in split order, so the result does not depend on timing.
#include <type_traits>

#include "common.cuh"
#include "launchers.h"
#include "lowrank_project.cuh"

namespace bem {
namespace {

constexpr int kWarps = 8, kThreads = 256;

// ---- coefficients ----

template <typename T, int MT, int NT>
__global__ void __launch_bounds__(kThreads, 2) prefill_coefficients_kernel(PrefillGradArgs a, int counters) {
  constexpr int kTokens = 16 * MT, kRanks = 8 * NT, kLd = kRanks + 1;  // odd stride spreads the banks
  __shared__ float zbuf[kWarps * kTokens * kLd];
  __shared__ float psum[kTokens * kRanks];
  __shared__ __align__(16) unsigned char stage[kWarps * kProjectStageBytes];
  const int warp = threadIdx.x / 32, M = a.M, r = a.r, m0 = blockIdx.x * kTokens;
  if (blockIdx.x == 0)
    for (int i = threadIdx.x; i < counters; i += kThreads) static_cast<int*>(a.ws)[i] = 0;
  unsigned char* my_stage = stage + warp * kProjectStageBytes;
  float* my_partials = zbuf + warp * kTokens * kLd;

  float z[MT][NT][4] = {};
  ChunkRange run = warp_chunks(a.K, 0, 1, warp, kWarps);
  project_chunks<T, MT, NT>(static_cast<const T*>(a.X), a.K, static_cast<const T*>(a.V), r, M, m0, run.begin,
                            run.end, my_stage, z);
  store_partials<MT, NT>(my_partials, kLd, z);
  __syncthreads();
  for (int e = threadIdx.x; e < kTokens * kRanks; e += kThreads) {
    const int tok = e / kRanks, j = e % kRanks;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += zbuf[(w * kTokens + tok) * kLd + j];
    psum[e] = sum;
  }
  __syncthreads();  // the partials' memory is G's now

#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int i = 0; i < 4; ++i) z[mt][nt][i] = 0.f;
  run = warp_chunks(a.N, 0, 1, warp, kWarps);
  project_chunks<T, MT, NT>(static_cast<const T*>(a.dY), a.N, static_cast<const T*>(a.U), r, M, m0, run.begin,
                            run.end, my_stage, z);
  store_partials<MT, NT>(my_partials, kLd, z);
  __syncthreads();
  const T* codes = static_cast<const T*>(a.codes);
  for (int e = threadIdx.x; e < kTokens * kRanks; e += kThreads) {
    const int tok = e / kRanks, j = e % kRanks, gm = m0 + tok;
    if (gm >= M || j >= r) continue;
    float G = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) G += zbuf[(w * kTokens + tok) * kLd + j];
    // as the composed backward's coefficient kernel (scale_codes.cu) rounds them
    const size_t at = (size_t)gm * r + j;
    const float c = codes ? to_acc(codes[at]) : 1.f, g = a.scale * G, p = psum[e];
    static_cast<T*>(a.low)[at] = from_acc<T>(g * c);
    static_cast<T*>(a.pc)[at] = from_acc<T>(a.scale * p * c);
    static_cast<T*>(a.dcodes)[at] = from_acc<T>(g * p);
  }
}

// ---- weight gradients ----

// A tile: kLanes threads across its columns (kCols each: 16 bytes at r = 8, 8 bytes at r = 16, so that a thread
// keeps 64 fp32 sums), kRowLanes across rows.
template <int R>
struct GradTile {
  static_assert(R == 8 || R == 16, "the weight-gradient kernel takes ranks 8 and 16");
  static constexpr int kCols = R == 8 ? 8 : 4, kLanes = 16, kRowLanes = kThreads / kLanes;
  static constexpr int kWidth = kCols * kLanes;  // columns of a tile
  static constexpr int kUnroll = 8;              // rows a thread loads before their products
};

// The split of both gradients' tiles over blocks: blockIdx.x a tile (dV's first), blockIdx.y a run of rows.
struct GradPlan {
  int tiles_v, tiles_u, splits, rows_per_split;
  int64_t partials_offset;  // bytes into the workspace (after the tiles' counters)
  __host__ __device__ int tiles() const { return tiles_v + tiles_u; }
};

template <int R>
GradPlan plan_of(const PrefillGradArgs& a) {
  using Tile = GradTile<R>;
  GradPlan p{};
  p.tiles_v = a.need_v ? (a.K + Tile::kWidth - 1) / Tile::kWidth : 0;
  p.tiles_u = a.need_u ? (a.N + Tile::kWidth - 1) / Tile::kWidth : 0;
  // As many runs as fill the GPU in one wave (two blocks a multiprocessor are resident), each at least 32 rows a
  // row lane: the sums at a block's end and the last block's over the runs cost about as much as a short run. A
  // second, nearly empty wave doubled the kernel's time (H100).
  const int tiles = p.tiles() > 0 ? p.tiles() : 1, sms = a.num_sms > 0 ? a.num_sms : 1;
  const int most = a.M / (32 * Tile::kRowLanes) > 1 ? a.M / (32 * Tile::kRowLanes) : 1;
  int splits = 2 * sms / tiles;
  splits = splits < 1 ? 1 : (splits > most ? most : (splits > 64 ? 64 : splits));
  p.rows_per_split = round_up((a.M + splits - 1) / splits, Tile::kRowLanes);
  p.splits = (a.M + p.rows_per_split - 1) / p.rows_per_split;
  p.partials_offset = round_up(p.tiles() * 4, 16);
  return p;
}

template <int R>
int64_t workspace_of(const PrefillGradArgs& a) {
  const GradPlan p = plan_of<R>(a);
  const int64_t partials = p.splits > 1 ? (int64_t)p.splits * p.tiles() * GradTile<R>::kWidth * R * 4 : 0;
  return p.partials_offset + partials;
}

template <typename T, int R>
__global__ void __launch_bounds__(kThreads, 2) prefill_weight_grads_kernel(PrefillGradArgs a, GradPlan p) {
  using Tile = GradTile<R>;
  constexpr int kC = Tile::kCols, kTileValues = Tile::kWidth * R;
  __shared__ float red[kWarps * kTileValues];
  __shared__ bool last;
  const int tile = blockIdx.x, split = blockIdx.y;
  const bool is_u = tile >= p.tiles_v;
  const T* A = static_cast<const T*>(is_u ? a.dY : a.X);
  const T* C = static_cast<const T*>(is_u ? a.pc : a.low);
  const int cols = is_u ? a.N : a.K;
  const int col0 = (is_u ? tile - p.tiles_v : tile) * Tile::kWidth;
  const int lane_col = threadIdx.x % Tile::kLanes, row_lane = threadIdx.x / Tile::kLanes;
  const int col = col0 + lane_col * kC;
  const bool col_ok = col < cols;  // cols % 8 == 0: a thread's columns are all in or all out
  const int m_begin = split * p.rows_per_split, m_end = min(a.M, m_begin + p.rows_per_split);

  // Each row's raw words first (kUnroll rows in flight), converted at their products: converted on load, fewer
  // rows fitted the registers beside the 64 sums.
  constexpr int kXWords = kC / 2, kCWords = R / 2;  // 32-bit words of a row's columns and coefficients
  float acc[kC][R] = {};
  for (int m = m_begin + row_lane; m < m_end; m += Tile::kRowLanes * Tile::kUnroll) {
    uint32_t xw[Tile::kUnroll][kXWords], cw[Tile::kUnroll][kCWords];
#pragma unroll
    for (int u = 0; u < Tile::kUnroll; ++u) {
      const int mu = m + u * Tile::kRowLanes;
      const bool row_ok = mu < m_end;
      if constexpr (kC == 8) {
        const uint4 v = row_ok && col_ok ? ld_stream16(A + (size_t)mu * cols + col) : zero4();
        xw[u][0] = v.x, xw[u][1] = v.y, xw[u][2] = v.z, xw[u][3] = v.w;
      } else {
        const uint2 v = row_ok && col_ok ? __ldcs(reinterpret_cast<const uint2*>(A + (size_t)mu * cols + col))
                                         : make_uint2(0, 0);
        xw[u][0] = v.x, xw[u][1] = v.y;
      }
#pragma unroll
      for (int h = 0; h < R / 8; ++h) {
        const uint4 v = row_ok ? ld_cached16(C + (size_t)mu * R + 8 * h) : zero4();
        cw[u][4 * h] = v.x, cw[u][4 * h + 1] = v.y, cw[u][4 * h + 2] = v.z, cw[u][4 * h + 3] = v.w;
      }
    }
#pragma unroll
    for (int u = 0; u < Tile::kUnroll; ++u) {
      const T* xv = reinterpret_cast<const T*>(xw[u]);
      const T* cv = reinterpret_cast<const T*>(cw[u]);
      float c[R];
#pragma unroll
      for (int j = 0; j < R; ++j) c[j] = to_acc(cv[j]);
#pragma unroll
      for (int i = 0; i < kC; ++i) {
        const float x = to_acc(xv[i]);
#pragma unroll
        for (int j = 0; j < R; ++j) acc[i][j] = fmaf(x, c[j], acc[i][j]);
      }
    }
  }

  // The block's rows summed in a fixed order: lane pairs of a warp (rows row_lane, row_lane + 1), then the warps.
  const int warp = threadIdx.x / 32;
#pragma unroll
  for (int i = 0; i < kC; ++i)
#pragma unroll
    for (int j = 0; j < R; ++j) acc[i][j] += __shfl_xor_sync(0xffffffffu, acc[i][j], 16);
  if (threadIdx.x % 32 < 16) {
#pragma unroll
    for (int i = 0; i < kC; ++i)
#pragma unroll
      for (int j = 0; j < R; ++j) red[warp * kTileValues + (lane_col * kC + i) * R + j] = acc[i][j];
  }
  __syncthreads();
  T* out = static_cast<T*>(is_u ? a.dU : a.dV);
  auto block_value = [&](int o) {
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += red[w * kTileValues + o];
    return sum;
  };
  if (p.splits == 1) {
    for (int o = threadIdx.x; o < kTileValues; o += kThreads)
      if (col0 + o / R < cols) out[(size_t)(col0 + o / R) * R + o % R] = from_acc<T>(block_value(o));
    return;
  }
  float* partials = reinterpret_cast<float*>(static_cast<unsigned char*>(a.ws) + p.partials_offset);
  for (int o = threadIdx.x; o < kTileValues; o += kThreads)
    partials[((size_t)split * p.tiles() + tile) * kTileValues + o] = block_value(o);
  __threadfence();  // this block's partials are visible device-wide before its count
  __syncthreads();
  if (threadIdx.x == 0) last = atomicAdd(static_cast<int*>(a.ws) + tile, 1) == p.splits - 1;
  __syncthreads();
  if (!last) return;
  __threadfence();
  for (int o = threadIdx.x; o < kTileValues; o += kThreads) {
    if (col0 + o / R >= cols) continue;
    float sum = 0.f;
#pragma unroll 8
    for (int s = 0; s < p.splits; ++s) sum += __ldcg(partials + ((size_t)s * p.tiles() + tile) * kTileValues + o);
    out[(size_t)(col0 + o / R) * R + o % R] = from_acc<T>(sum);
  }
}

// fn(R) for the rank the kernels take (8 or 16) as a compile-time constant.
template <typename Fn>
auto by_rank(int r, Fn&& fn) {
  return r == 8 ? fn(std::integral_constant<int, 8>{}) : fn(std::integral_constant<int, 16>{});
}

// Two blocks a multiprocessor's worth of 32-row blocks, else 16 rows a block.
bool tall_blocks(const PrefillGradArgs& a) { return (a.M + 31) / 32 >= 2 * (a.num_sms > 0 ? a.num_sms : 1); }

template <typename T, int MT, int NT>
cudaError_t launch_coefficients(const PrefillGradArgs& a, int counters, cudaStream_t stream) {
  const int blocks = (a.M + 16 * MT - 1) / (16 * MT);
  prefill_coefficients_kernel<T, MT, NT><<<blocks, kThreads, 0, stream>>>(a, counters);
  return cudaGetLastError();
}

}  // namespace

bool prefill_grads_fit(const PrefillGradArgs& a) {
  return (a.r == 8 || a.r == 16) && a.M >= 1 && a.K % 8 == 0 && a.N % 8 == 0 && aligned16(a.X) && aligned16(a.dY) &&
         aligned16(a.V) && aligned16(a.U);
}

int64_t prefill_grads_workspace(const PrefillGradArgs& a) {
  return by_rank(a.r, [&](auto rank) { return workspace_of<decltype(rank)::value>(a); });
}

cudaError_t launch_prefill_coefficients(DType dtype, const PrefillGradArgs& a, cudaStream_t stream) {
  if (!prefill_grads_fit(a)) return cudaErrorInvalidValue;
  const int counters = by_rank(a.r, [&](auto rank) { return plan_of<decltype(rank)::value>(a).tiles(); });
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.r == 8) return tall_blocks(a) ? launch_coefficients<T, 2, 1>(a, counters, stream)
                                        : launch_coefficients<T, 1, 1>(a, counters, stream);
    return tall_blocks(a) ? launch_coefficients<T, 2, 2>(a, counters, stream)
                          : launch_coefficients<T, 1, 2>(a, counters, stream);
  });
}

cudaError_t launch_prefill_weight_grads(DType dtype, const PrefillGradArgs& a, cudaStream_t stream) {
  if (!prefill_grads_fit(a)) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    return by_rank(a.r, [&](auto rank) {
      constexpr int R = decltype(rank)::value;
      const GradPlan p = plan_of<R>(a);
      if (p.tiles() == 0) return cudaSuccess;
      prefill_weight_grads_kernel<T, R><<<dim3(p.tiles(), p.splits), kThreads, 0, stream>>>(a, p);
      return cudaGetLastError();
    });
  });
}

}  // namespace bem
