// The end the two transposed-weight decode kernels share (decode_columns.cu on CUDA cores, decode_columns_mma.cu
// on the tensor cores): the block's sums of its warps' partial X W^T and X V, in warp order, then one cluster
// barrier makes them visible to the cluster; every block sums the cluster's X V for itself (and the
// first writes it as P for the backward), then the cluster's X W^T for its own 64 / cs columns in a fixed order,
// adds the update with the whole X V and the bias, and writes Y.
#pragma once

#include "../common/common.cuh"
#include "launchers.h"

namespace bem {
namespace {

// yb and zb (tokens [0, rows) x columns, and ranks [0, ranks) with zeros up to MaxRank) as the sums of the warps'
// stage_y and stage_z in warp order. After a barrier that follows the warps' writes.
template <int Threads, int Warps, int Tok, int Cols, int MaxRank>
__device__ __forceinline__ void columns_block_sums(int rows, int ranks, const float (*stage_y)[Tok][Cols],
                                                   const float (*stage_z)[Tok][MaxRank], float (&yb)[Tok][Cols],
                                                   float (&zb)[Tok][MaxRank]) {
  const int tid = threadIdx.x;
  for (int i = tid; i < rows * Cols; i += Threads) {
    const int m = i / Cols, c = i % Cols;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < Warps; ++w) sum += stage_y[w][m][c];
    yb[m][c] = sum;
  }
  for (int i = tid; i < rows * MaxRank; i += Threads) {
    const int m = i / MaxRank, j = i % MaxRank;
    float sum = 0.f;
    if (j < ranks) {
#pragma unroll
      for (int w = 0; w < Warps; ++w) sum += stage_z[w][m][j];
    }
    zb[m][j] = sum;
  }
}

template <typename T, int Threads, int Tok, int Cols, int MaxRank, typename Cluster>
__device__ __forceinline__ void columns_cluster_end(Cluster& cluster, const DecodeArgs& p, int n0,
                                                    float (&yb)[Tok][Cols], float (&zb)[Tok][MaxRank],
                                                    float (&zc)[Tok][MaxRank]) {
  const int cs = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int M = p.M, N = p.N, r = p.r, tid = threadIdx.x;
  const T* codes = static_cast<const T*>(p.codes);
  const T* U = static_cast<const T*>(p.U);
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  cluster.sync();  // every block's partial sums are complete and visible to the cluster

  // ---- The whole X V, in every block; X V for the backward from the first block ----
  float* zb_flat = &zb[0][0];
  for (int i = tid; i < M * r; i += Threads) {
    const int m = i / r, j = i % r;
    const float sum = cluster_sum<kDecodeStreamMaxCluster>(cluster, zb_flat, m * MaxRank + j, cs);
    if (p.P && blockIdx.y == 0 && rank == 0) p.P[m * r + j] = sum;
    zc[m][j] = sum * p.scale * (codes ? to_acc(codes[m * r + j]) : 1.f);
  }
  __syncthreads();

  // ---- This block's Cols / cs columns: the cluster's X W^T in a fixed order, the update, the bias ----
  const int cols = Cols / cs, col_begin = rank * cols;
  float* yb_flat = &yb[0][0];
  for (int i = tid; i < cols * M; i += Threads) {
    const int col = col_begin + i % cols, m = i / cols, nn = n0 + col;
    if (nn >= N) continue;
    float out = cluster_sum<kDecodeStreamMaxCluster>(cluster, yb_flat, m * Cols + col, cs);
    const T* u = U + (size_t)nn * r;
    for (int j = 0; j < r; ++j) out = fmaf(zc[m][j], to_acc(u[j]), out);
    if (bias) out += to_acc(bias[nn]);
    Y[(size_t)m * N + nn] = from_acc<T>(out);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
}

}  // namespace
}  // namespace bem
