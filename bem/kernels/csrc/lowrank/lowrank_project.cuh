// One warp's share of a projection P = A B on the tensor cores, for a block of 16 MT rows of A and 8 NT
// columns of B (ranks): the streaming update kernel's first phase (lowrank_stream.cu) and the prefill
// backward's coefficient kernel (lowrank_prefill_grads.cu) both sum their warps' shares of K this way.
//
// A streams in with 16-byte loads straight into tensor-core registers (the k-map of common.cuh): long
// contiguous runs, no shared-memory staging, no barrier. B's rows pass through a small per-warp staging
// tile into the same k-map, each serving the block's MT row tiles.
#pragma once

#include "../common/common.cuh"

namespace bem {

constexpr int kProjectChunk = 32;          // columns of K per chunk: 8 per thread of a quad
constexpr int kProjectLoadsInFlight = 16;  // 16-byte loads of A per thread issued before their products
constexpr int kProjectStageBytes = 512;    // a warp's staging tile for B: 32 rows of K x 8 ranks

// z[mt][nt] += A[m0 + 16 mt + (g, g + 8), chunks q_begin .. q_end of K] B[those k, ranks 8 nt + (2c, 2c + 1)]
// for this warp (lane = 4 g + c). A: M x L row-major with L % 8 == 0; B: L x r row-major (rank-contiguous) with
// r % 8 == 0; both 16-byte aligned. Rows past M and ranks past r contribute zeros. stage: this warp's
// kProjectStageBytes of shared memory, 16-byte aligned.
template <typename T, int MT, int NT>
__device__ __forceinline__ void project_chunks(const T* A, int L, const T* B, int r, int M, int m0, int q_begin,
                                               int q_end, unsigned char* stage, float (&z)[MT][NT][4]) {
  constexpr int kBatch = kProjectLoadsInFlight / (2 * MT);  // K chunks loaded at once
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const T* a_base = A + (size_t)m0 * L + 8 * c;
  bool row_ok[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_ok[mt][h] = m0 + 16 * mt + 8 * h + g < M;
  // B as the mma B operand, where thread (g, c) needs B's k = 8c..8c+7 (its A fragment's k) at rank g of a
  // rank tile: lane l loads row k + l of the tile (16 bytes) and stores it at row 8t + 2c' + u of the warp's
  // staging tile (l = 8c' + 2t + u), so that ldmatrix.trans hands thread (g, c) the k pairs (8c + 2t,
  // 8c + 2t + 1) of rank g as word t. No transposed copy of B is needed.
  const unsigned stage_address = smem_address(stage) + 16 * lane;
  uint4* stage_row = reinterpret_cast<uint4*>(stage) + 8 * ((lane % 8) / 2) + 2 * (lane / 8) + lane % 2;
  for (int q = q_begin; q < q_end; q += kBatch) {
    uint4 xa[kBatch][MT][2];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int k = (q + i) * kProjectChunk;
      const bool in = q + i < q_end && k + 8 * c < L;  // L % 8 == 0: a group of 8 is all in or out
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xa[i][mt][h] = in && row_ok[mt][h] ? ld_stream16(a_base + (size_t)(16 * mt + 8 * h + g) * L + k) : zero4();
    }
    // B's rows: every chunk's requested with A's where the registers allow (one latency for the batch, not
    // one a chunk), else each chunk's just before its products.
    constexpr int kBChunks = kBatch * NT <= 16 ? kBatch : 1;
    uint4 b_rows[kBChunks][NT];
    auto load_b = [&](int i, uint4 (&rows)[NT]) {
      const int k = (q + i) * kProjectChunk;
      const bool row_in = q + i < q_end && k + lane < L;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt)
        rows[nt] = row_in && 8 * nt < r ? ld_cached16(B + (size_t)(k + lane) * r + 8 * nt) : zero4();
    };
    if constexpr (kBChunks > 1) {
#pragma unroll
      for (int i = 0; i < kBatch; ++i) load_b(i, b_rows[i]);
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      if constexpr (kBChunks == 1) load_b(i, b_rows[0]);
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        *stage_row = b_rows[kBChunks > 1 ? i : 0][nt];
        __syncwarp();
        const uint4 vb = ldmatrix_x4_trans(stage_address);
        __syncwarp();  // every lane has its operands before the next tile overwrites the staging tile
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint4 x0 = xa[i][mt][0], x1 = xa[i][mt][1];
          mma_16816<T>(z[mt][nt], x0.x, x1.x, x0.y, x1.y, vb.x, vb.y);
          mma_16816<T>(z[mt][nt], x0.z, x1.z, x0.w, x1.w, vb.z, vb.w);
        }
      }
    }
  }
}

// A warp's z (rows 16 mt + (g, g + 8) x ranks 8 nt + (2c, 2c + 1)) into its rows x ranks slice zs (stride ld)
// of shared memory, where the block sums its warps' shares in a fixed order.
template <int MT, int NT>
__device__ __forceinline__ void store_partials(float* zs, int ld, const float (&z)[MT][NT][4]) {
  const int lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int t0 = 16 * mt + g, j = 8 * nt + 2 * c;
      zs[t0 * ld + j] = z[mt][nt][0];
      zs[t0 * ld + j + 1] = z[mt][nt][1];
      zs[(t0 + 8) * ld + j] = z[mt][nt][2];
      zs[(t0 + 8) * ld + j + 1] = z[mt][nt][3];
    }
}

// The K chunks [begin, end) of warp `warp` of 8 in slice `slice` of `slices` (clusters split K over their blocks).
struct ChunkRange {
  int begin, end;
};
__device__ __forceinline__ ChunkRange warp_chunks(int L, int slice, int slices, int warp, int warps) {
  const int chunks = (L + kProjectChunk - 1) / kProjectChunk;
  const int per_slice = (chunks + slices - 1) / slices;
  const int slice_begin = min(chunks, slice * per_slice), slice_end = min(chunks, slice_begin + per_slice);
  const int per_warp = (slice_end - slice_begin + warps - 1) / warps;
  const int begin = slice_begin + warp * per_warp;
  return {begin, min(slice_end, begin + per_warp)};
}

}  // namespace bem
