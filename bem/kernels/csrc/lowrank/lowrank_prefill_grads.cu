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
// - the weight-gradient kernel: a block owns a tile of 128 columns of X (for dV) or dY (for dU) over a run of
//   rows, staged through shared memory, each warp 16 columns against all r ranks on the tensor cores. Runs of rows
//   are split over blocks to fill the GPU; their fp32 partials go to a workspace, and the last block of a tile (a
//   counter the coefficient kernel zeroed) sums them in run order, so the result does not depend on timing.
#include <type_traits>

#include "../common/common.cuh"
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
    const size_t at = (size_t)gm * r + j;
    const float c = codes ? to_acc(codes[at]) : 1.f;
    store_coefficients<T>(G, psum[e], c, a.scale, at, static_cast<T*>(a.low), static_cast<T*>(a.pc),
                          static_cast<T*>(a.dcodes));
  }
}

// ---- weight gradients ----

// dV = X^T low as tensor-core products: a block's 8 warps each own 16 columns of a 128-column tile of X (or dY), so
// a warp's 16 x r accumulator is its columns' whole sum over the block's run of rows (no reduction in the block).
// Rows come through shared memory in stages of 32 (cp.async, kStages deep), where ldmatrix.trans hands each warp
// X^T's and the coefficients' fragments.
constexpr int kStageRows = 32, kStages = 4;

template <int R>
struct GradTile {
  static_assert(R == 8 || R == 16, "the weight-gradient kernel takes ranks 8 and 16");
  static constexpr int kWidth = 128;             // columns of a tile: 16 a warp
  static constexpr int kXLd = kWidth * 2 + 16;   // bytes a staged row of X, padded: ldmatrix's 8 rows on distinct banks
  static constexpr int kCLd = R == 8 ? 16 : 48;  // bytes a staged row of coefficients (32 padded to 48: the same)
  static constexpr int kStageBytes = kStageRows * (kXLd + kCLd);
  static constexpr int kMinRunRows = 256;        // rows a block's run takes at least (eight stages)
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
  // Enough runs that every multiprocessor holds four blocks (about 37-41 KB of stages each), all resident at once:
  // a second, nearly empty wave doubled an earlier form's time (H100).
  const int tiles = p.tiles() > 0 ? p.tiles() : 1, sms = a.num_sms > 0 ? a.num_sms : 1;
  const int most = a.M / Tile::kMinRunRows > 1 ? a.M / Tile::kMinRunRows : 1;
  int splits = 4 * sms / tiles;
  splits = splits < 1 ? 1 : (splits > most ? most : (splits > 64 ? 64 : splits));
  p.rows_per_split = round_up((a.M + splits - 1) / splits, kStageRows);
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
__global__ void __launch_bounds__(kThreads) prefill_weight_grads_kernel(PrefillGradArgs a, GradPlan p) {
  using Tile = GradTile<R>;
  constexpr int NT = R / 8, kTileValues = Tile::kWidth * R;
  __shared__ __align__(128) unsigned char stages[kStages * Tile::kStageBytes];
  __shared__ bool last;
  const int tile = blockIdx.x, split = blockIdx.y;
  const bool is_u = tile >= p.tiles_v;
  const T* A = static_cast<const T*>(is_u ? a.dY : a.X);
  const T* C = static_cast<const T*>(is_u ? a.pc : a.low);
  const int cols = is_u ? a.N : a.K;
  const int col0 = (is_u ? tile - p.tiles_v : tile) * Tile::kWidth;
  const int m_begin = split * p.rows_per_split, m_end = min(a.M, m_begin + p.rows_per_split);
  const int steps = (m_end - m_begin + kStageRows - 1) / kStageRows;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;

  auto x_stage = [&](int s) { return stages + s * Tile::kStageBytes; };
  auto c_stage = [&](int s) { return stages + s * Tile::kStageBytes + kStageRows * Tile::kXLd; };
  auto load_stage = [&](int step, int s) {  // rows past the run and columns past the matrix read as zeros
    const int m0 = m_begin + step * kStageRows;
    for (int i = threadIdx.x; i < kStageRows * (Tile::kWidth / 8); i += kThreads) {
      const int row = i / (Tile::kWidth / 8), chunk = i % (Tile::kWidth / 8), m = m0 + row, col = col0 + 8 * chunk;
      const bool ok = m < m_end && col < cols;  // cols % 8 == 0
      cp_async16(x_stage(s) + row * Tile::kXLd + 16 * chunk, ok ? A + (size_t)m * cols + col : A, ok);
    }
    for (int i = threadIdx.x; i < kStageRows * NT; i += kThreads) {
      const int row = i / NT, chunk = i % NT, m = m0 + row;
      cp_async16(c_stage(s) + row * Tile::kCLd + 16 * chunk, m < m_end ? C + (size_t)m * R + 8 * chunk : C,
                 m < m_end);
    }
  };
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < steps) load_stage(s, s);
    cp_async_commit();
  }
  // ldmatrix row addresses of this lane: X^T's four 8 x 8 tiles (rows m, columns this warp's 16) and the
  // coefficients' (rows m, ranks 8 a tile).
  const int x_row = lane % 8 + 8 * (lane / 16), x_col = warp * 16 + 8 * ((lane / 8) % 2);
  const int c_row = NT == 1 ? lane % 16 : lane % 8 + 8 * ((lane / 8) % 2), c_col = NT == 1 ? 0 : 16 * (lane / 16);
  float d[NT][4] = {};
  for (int step = 0; step < steps; ++step) {
    cp_async_wait<kStages - 2>();
    __syncthreads();  // this step's stage is in; every warp is done with the stage the next load overwrites
    if (step + kStages - 1 < steps) load_stage(step + kStages - 1, (step + kStages - 1) % kStages);
    cp_async_commit();
    const int s = step % kStages;
#pragma unroll
    for (int h = 0; h < kStageRows / 16; ++h) {
      // word i: X^T (columns g | g + 8, rows 2c, 2c + 1 | + 8) = the A fragment {row g lo, g+8 lo, g hi, g+8 hi}
      const uint4 xa = ldmatrix_x4_trans(smem_address(x_stage(s) + (16 * h + x_row) * Tile::kXLd + 2 * x_col));
      const unsigned c_at = smem_address(c_stage(s) + (16 * h + c_row) * Tile::kCLd + c_col);
      if constexpr (NT == 1) {
        const uint2 cb = ldmatrix_x2_trans(c_at);
        mma_16816<T>(d[0], xa.x, xa.y, xa.z, xa.w, cb.x, cb.y);
      } else {
        const uint4 cb = ldmatrix_x4_trans(c_at);
        mma_16816<T>(d[0], xa.x, xa.y, xa.z, xa.w, cb.x, cb.y);
        mma_16816<T>(d[1], xa.x, xa.y, xa.z, xa.w, cb.z, cb.w);
      }
    }
  }
  cp_async_wait<0>();

  // d[nt][q]: column warp 16 + g (+ 8 for q >= 2) of the tile, rank 8 nt + 2c (+ 1 for odd q)
  T* out = static_cast<T*>(is_u ? a.dU : a.dV);
  auto local = [&](int nt, int q) { return (warp * 16 + g + 8 * (q / 2)) * R + 8 * nt + 2 * c + q % 2; };
  if (p.splits == 1) {
#pragma unroll
    for (int nt = 0; nt < NT; ++nt)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int o = local(nt, q);
        if (col0 + o / R < cols) out[(size_t)col0 * R + o] = from_acc<T>(d[nt][q]);
      }
    return;
  }
  float* partials = reinterpret_cast<float*>(static_cast<unsigned char*>(a.ws) + p.partials_offset);
  float* mine = partials + ((size_t)split * p.tiles() + tile) * kTileValues;
#pragma unroll
  for (int nt = 0; nt < NT; ++nt)
#pragma unroll
    for (int q = 0; q < 4; ++q) mine[local(nt, q)] = d[nt][q];
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
    out[(size_t)col0 * R + o] = from_acc<T>(sum);
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
