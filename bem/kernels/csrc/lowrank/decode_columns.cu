// The BEM linear at decode sizes for a weight stored transposed, K x N row-major (GPT-2's Conv1D), on
// CUDA cores (sm_90, M <= kDecodeColumnsMaxTokens = 4):
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// The tensor-core kernels want pairs of consecutive k in a register, which a K x N layout does not give
// without a transpose through shared memory; at a few tokens the arithmetic is small enough for plain
// FMAs, so this kernel just streams W: each thread reads 8 consecutive columns (16 bytes) of one row k
// at a time and keeps the 8 x M partial sums, and X V's partial sums beside them. A block owns 64
// columns over a slice of K (32 rows of threads, 8 threads a row: each warp reads 4 rows of 128
// contiguous bytes); the cs blocks that share those columns form a thread-block cluster and split K.
// After the stream, the block sums its 32 rows of partials (shuffles, then shared memory), one cluster
// barrier makes every block's sums visible, each block sums the cluster's X V for itself and the
// cluster's partial X W^T for its 64 / cs columns in a fixed order (deterministic, no workspace), adds
// the update with the whole X V, the bias, and writes Y.

#include <cooperative_groups.h>

#include "../common/common.cuh"
#include "decode_columns_end.cuh"
#include "launchers.h"

namespace bem {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kGroups = 8;                    // 8-column groups a row of threads: 64 columns a block
constexpr int kCols = kGroups * 8;
constexpr int kRowsOfThreads = kThreads / kGroups;  // 32 rows of K in flight a block
constexpr int kMaxRank = kDecodeColumnsMaxRank;

// RZ: ranks a thread keeps per token (ranks ng, ng + 8, ...): 1, 2, 4 or 8 (r up to 8, 16, 32, 64).
template <typename T, int MT, int RZ>
__global__ void __launch_bounds__(kThreads) decode_columns_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float stage_y[kWarps][MT][kCols];  // each warp's sums over its 4 rows
  __shared__ float stage_z[kWarps][MT][kMaxRank];
  __shared__ float yb[MT][kCols];               // this block's partial X W^T (read by the cluster)
  __shared__ float zb[MT][kMaxRank];            // this block's partial X V (read by the cluster)
  __shared__ float zc[MT][kMaxRank];            // s (X V) ⊙ codes over the whole of K
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();

  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* V = static_cast<const T*>(p.V);
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32;
  const int ng = tid % kGroups, kr = tid / kGroups;
  const int n0 = blockIdx.y * kCols;
  const int n = n0 + 8 * ng;
  const bool col_ok = n < N;  // N % 8 == 0: a group of 8 columns is all in or all out
  const int k_begin = rank * p.k_per_split;
  const int k_end = min(K, k_begin + p.k_per_split);

  float y[MT][8], z[MT][RZ];
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int e = 0; e < 8; ++e) y[m][e] = 0.f;
#pragma unroll
    for (int i = 0; i < RZ; ++i) z[m][i] = 0.f;
  }

#pragma unroll 4
  for (int k = k_begin + kr; k < k_end; k += kRowsOfThreads) {
    const uint4 raw = col_ok ? ld_stream16(W + (size_t)k * N + n) : zero4();
    float x[MT];
#pragma unroll
    for (int m = 0; m < MT; ++m) x[m] = m < M ? to_acc(X[(size_t)m * K + k]) : 0.f;
    float w[8];
    unpack8<T>(raw, w);
#pragma unroll
    for (int m = 0; m < MT; ++m)
#pragma unroll
      for (int e = 0; e < 8; ++e) y[m][e] = fmaf(x[m], w[e], y[m][e]);
#pragma unroll
    for (int i = 0; i < RZ; ++i) {
      const int j = ng + 8 * i;
      const float v = j < r ? to_acc(V[(size_t)k * r + j]) : 0.f;
#pragma unroll
      for (int m = 0; m < MT; ++m) z[m][i] = fmaf(x[m], v, z[m][i]);
    }
  }

  // ---- The block's sums: the warp's 4 rows by shuffles, then the 8 warps through shared memory ----
#pragma unroll
  for (int m = 0; m < MT; ++m) {
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      y[m][e] += __shfl_xor_sync(0xffffffffu, y[m][e], 8);
      y[m][e] += __shfl_xor_sync(0xffffffffu, y[m][e], 16);
    }
#pragma unroll
    for (int i = 0; i < RZ; ++i) {
      z[m][i] += __shfl_xor_sync(0xffffffffu, z[m][i], 8);
      z[m][i] += __shfl_xor_sync(0xffffffffu, z[m][i], 16);
    }
  }
  if (lane < kGroups) {
#pragma unroll
    for (int m = 0; m < MT; ++m) {
#pragma unroll
      for (int e = 0; e < 8; ++e) stage_y[warp][m][8 * ng + e] = y[m][e];
#pragma unroll
      for (int i = 0; i < RZ; ++i) stage_z[warp][m][ng + 8 * i] = z[m][i];
    }
  }
  __syncthreads();
  columns_block_sums<kThreads, kWarps>(MT, 8 * RZ, stage_y, stage_z, yb, zb);
  columns_cluster_end<T, kThreads>(cluster, p, n0, yb, zb, zc);
#endif
}

template <typename T> using ColumnsKernel = void (*)(DecodeArgs);

// The form of the kernel for M tokens (1, 2 or 4 a block) at rank r (up to 8, 16, 32 or 64): what launches and
// what the occupancy query asks about (the float16 form's resources are the bfloat16 one's).
template <typename T, int MT>
ColumnsKernel<T> columns_kernel_rank(int r) {
  return r <= 8 ? decode_columns_kernel<T, MT, 1>
         : r <= 16 ? decode_columns_kernel<T, MT, 2>
         : r <= 32 ? decode_columns_kernel<T, MT, 4>
                   : decode_columns_kernel<T, MT, 8>;
}

template <typename T>
ColumnsKernel<T> columns_kernel(int M, int r) {
  static_assert(kDecodeColumnsMaxTokens == 4, "forms for 1, 2 and 4 tokens");
  return M <= 1 ? columns_kernel_rank<T, 1>(r) : M <= 2 ? columns_kernel_rank<T, 2>(r) : columns_kernel_rank<T, 4>(r);
}

template <typename T>
cudaError_t launch_tokens(const DecodeArgs& a, cudaStream_t stream) {
  cudaLaunchAttribute attribute;
  const dim3 grid(a.split_k, (a.N + kCols - 1) / kCols, 1);
  const cudaLaunchConfig_t config = cluster_launch_config(grid, kThreads, 0, stream, a.split_k, attribute);
  return cudaLaunchKernelEx(&config, columns_kernel<T>(a.M, a.r), a);
}

// Clusters of `cs` blocks resident at once (common.cuh) for the form that takes M tokens at rank r (its
// registers set how many blocks a multiprocessor holds).
int resident_column_clusters(int cs, int M, int r, int device) {
  const void* kernel = (const void*)columns_kernel<__nv_bfloat16>(M, r);
  return resident_clusters_of(kernel, device, cs, [cs](cudaLaunchConfig_t& config, cudaLaunchAttribute* attribute) {
    config = cluster_launch_config(dim3(cs, 1, 1), kThreads, 0, nullptr, cs, attribute[0]);
    return cudaSuccess;
  });
}

}  // namespace

bool decode_columns_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && a.w_transposed && a.M >= 1 && a.M <= kDecodeColumnsMaxTokens && a.K >= 1 &&
         a.N % 8 == 0 && a.r >= 1 && a.r <= kDecodeColumnsMaxRank && aligned16(a.W);
}

bool decode_columns_takes(const DecodeArgs& a) {
  // Where it measured ahead of the tensor-core kernel (H100, x F.linear at GPT-2's shapes, CUDA-graph replays):
  // at 1 and 2 tokens on 768 -> 2304, 768² and 768 -> 3072 (1 token: 1.33-1.54 against 1.56-1.74); from 3 tokens
  // (its 4-token form) the tensor-core kernel led on three of the four, and at K = 4 N (3072 -> 768) from one
  // token (1.10 against 1.20).
  return a.M <= 2 && a.K < 2 * a.N;
}

int decode_columns_split(int M, int N, int K, int r, int device) {
  // The largest cluster (K split) whose grid runs in one wave, with at least 2 rows of K a thread.
  const int tiles = (N + kCols - 1) / kCols;
  return largest_one_wave_cluster(K, 2 * kRowsOfThreads, tiles, kDecodeStreamMaxCluster,
                                  [=](int cs) { return resident_column_clusters(cs, M, r, device); });
}

cudaError_t launch_decode_columns(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.split_k < 1 || args.split_k > kDecodeStreamMaxCluster || (args.split_k & (args.split_k - 1)) != 0 ||
      (size_t)args.split_k * args.k_per_split < (size_t)args.K)
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_tokens<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
