// The X V half of the streaming decode kernels (decode_stream.cu, decode_tma.cu): the geometry the launches share,
// one warp's X V over a slice of K (SliceProjection, which the stream's in-block form uses too) and the
// projection launch (decode_project_kernel) that computes Pc = s (X V) ⊙ c once for the stream launched
// after it, and U's operand words for the update. Included by decode_stream.cu, decode_tma.cu and decode_rows.cu.
#pragma once

#include <cooperative_groups.h>

#include "../common/common.cuh"
#include "../common/l2_prefetch.cuh"
#include "launchers.h"

namespace bem {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256; // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 32;    // k per 16-byte load across the 4 threads of a row
constexpr int kTokens = kDecodeStreamMaxTokens;
constexpr int kPartFloats = kTokens * 8;  // one warp's X V result: 16 tokens x 8 ranks

// The projection launch's cluster: up to kProjectBlocks blocks split K, at least kProjectMinK columns each.
constexpr int kProjectBlocks = 8;
constexpr int kProjectMinK = 256;
// Chunks whose loads a warp has in flight at once. At rank 64 each warp walks its block's whole slice
// (one rank tile per warp), so the batch sets how many latencies the projection waits in series.
// Measured on an H200 (x F.linear, M = 1, 4096²): 4 -> 8 took r = 64 from 1.52 to 1.36 (M = 16: 1.69
// -> 1.62), other shapes within the spread; 16 (M <= 8) was slower on the same machine (r = 32 1.15
// -> 1.20, r = 64 1.36 -> 1.41).
constexpr int kProjectBatch = 8;

__device__ __forceinline__ void launch_dependents() { asm volatile("griddepcontrol.launch_dependents;\n" ::: "memory"); }
// Returns once the launch this one depends on has finished and its writes are visible (at once when
// this grid was launched without a programmatic dependency: the stream's order already holds).
__device__ __forceinline__ void wait_for_prerequisite() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }

// U[row][j], U[row][j + 1] as one mma operand word, zeros past the rank or outside the matrix.
template <typename T>
__device__ __forceinline__ uint32_t u_pair(const T* u_row, bool row_ok, int j, int r) {
  const T zero = from_acc<T>(0.f);
  return pack2(row_ok && j < r ? u_row[j] : zero, row_ok && j + 1 < r ? u_row[j + 1] : zero);
}

// The projection launch's blocks for K (one cluster).
inline int project_blocks(int K) {
  int blocks = kProjectBlocks;
  while (blocks > 1 && K / blocks < kProjectMinK) blocks /= 2;
  return blocks;
}

// One warp's share of X V over a block's slice [k_begin, k_end) of K: tokens as the m16 rows of
// mma.sync, 8 ranks per n8 tile; warp w takes rank tile w / kparts over every kparts-th chunk.
// V is K x r, rank-contiguous, while an mma B operand holds pairs along k: thread (g, c) needs V's
// k = 8c..8c+7 (its x fragment's k) at rank j. Where V's rows are 16-byte aligned (r % 8 == 0), each
// lane loads one k-row of the warp's 8-rank tile in one 16-byte load and a per-warp staging tile (512
// bytes) with ldmatrix.trans hands out the operands; otherwise each thread loads its 8 values one by one.
template <typename T, int NT>
struct SliceProjection {
  const T* x0;
  const T* x1;
  const T* V;
  int r, k_begin, k_end, nchunks, kparts, kp, jt, j, lane, c;
  bool x_ok0, x_ok1, v_rows, live;
  unsigned stage_address;
  uint4* stage_row;

  __device__ SliceProjection(const DecodeArgs& p, int begin, int end, unsigned char* stage) {
    const int warp = threadIdx.x / 32, g = (threadIdx.x % 32) / 4;
    lane = threadIdx.x % 32;
    c = lane % 4;
    r = p.r;
    k_begin = begin;
    k_end = end;
    nchunks = k_end > k_begin ? (k_end - k_begin + kChunk - 1) / kChunk : 0;
    const int jtiles = (r + 7) / 8;
    kparts = kWarps / jtiles;
    live = warp < jtiles * kparts;
    jt = warp / kparts;
    kp = warp % kparts;
    j = jt * 8 + g;
    const T* X = static_cast<const T*>(p.X);
    x_ok0 = g < p.M;
    x_ok1 = g + 8 < p.M;
    x0 = X + (size_t)(x_ok0 ? g : 0) * p.K + 8 * c;
    x1 = X + (size_t)(x_ok1 ? g + 8 : 0) * p.K + 8 * c;
    V = static_cast<const T*>(p.V);
    v_rows = r % 8 == 0 && (reinterpret_cast<uintptr_t>(V) & 15) == 0;
    // Lane L = 8c + 2t + u holds k-row L and stores it at row 8t + 2c + u of the staging tile, so that
    // ldmatrix.trans gives thread (g, c) the k pairs (8c + 2t, 8c + 2t + 1) of rank g as word t.
    stage_address = smem_address(stage) + 16 * lane;
    stage_row = reinterpret_cast<uint4*>(stage) + 8 * ((lane % 8) / 2) + 2 * (lane / 8) + lane % 2;
  }

  // Chunk q's operands (zeros past the slice, or for a warp without a job): x's two fragments, and V's
  // staged row or four operand words.
  __device__ __forceinline__ void load(int q, uint4& a0, uint4& a1, uint4& v) const {
    const int k = k_begin + q * kChunk;
    const bool in = live && q < nchunks && k + 8 * c < k_end;
    a0 = in && x_ok0 ? ld_cached16(x0 + k) : zero4();
    a1 = NT == 2 && in && x_ok1 ? ld_cached16(x1 + k) : zero4();  // NT == 1: M <= 8, no row g + 8
    load_v(q, v);
  }

  // V's part of chunk q alone, for a caller that holds the chunk's x fragments already.
  __device__ __forceinline__ void load_v(int q, uint4& v) const {
    const int k = k_begin + q * kChunk;
    if (v_rows) {
      const bool row_in = live && q < nchunks && k + lane < k_end;
      v = row_in ? ld_cached16(V + (size_t)(k + lane) * r + 8 * jt) : zero4();
      return;
    }
    const bool v_in = live && q < nchunks && k + 8 * c < k_end && j < r;
    const T* vp = V + (v_in ? (size_t)(k + 8 * c) * r + j : 0);
    T e[8];
#pragma unroll
    for (int i = 0; i < 8; ++i) e[i] = v_in ? vp[(size_t)i * r] : from_acc<T>(0.f);
    v = make_uint4(pack2(e[0], e[1]), pack2(e[2], e[3]), pack2(e[4], e[5]), pack2(e[6], e[7]));
  }

  __device__ __forceinline__ void mma(float (&z)[4], const uint4& a0, const uint4& a1, uint4 v) const {
    if (v_rows) {  // uniform over the block
      *stage_row = v;
      __syncwarp();
      v = ldmatrix_x4_trans(stage_address);
      __syncwarp();  // every lane has its operands before the next chunk overwrites the tile
    }
    mma_16816<T>(z, a0.x, a1.x, a0.y, a1.y, v.x, v.y);
    mma_16816<T>(z, a0.z, a1.z, a0.w, a1.w, v.z, v.w);
  }

  // z (tokens g, g + 8 x ranks 2c, 2c + 1 of the warp's tile) into the warp's 16 x 8 part.
  __device__ __forceinline__ void store(float* part, const float (&z)[4]) const {
    const int g = lane / 4;
    part[g * 8 + 2 * c] = z[0];
    part[g * 8 + 2 * c + 1] = z[1];
    part[(g + 8) * 8 + 2 * c] = z[2];
    part[(g + 8) * 8 + 2 * c + 1] = z[3];
  }

  // Element (m, jj) of the block's X V from the warps' parts, summed in a fixed order. After a barrier.
  __device__ __forceinline__ float block_sum(const float* zpart, int m, int jj) const {
    float sum = 0.f;
    for (int part = 0; part < kparts; ++part) sum += zpart[((jj / 8) * kparts + part) * kPartFloats + m * 8 + jj % 8];
    return sum;
  }
};

// Pc = s (X V) ⊙ c (M x rp, input dtype, zero past r) and P = X V (fp32, when p.P is set), on one
// cluster whose blocks split K, for the stream launched after it.
template <typename T, int NT>
__global__ void __launch_bounds__(kThreads) decode_project_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  __shared__ float zpart[kWarps * kPartFloats];
  __shared__ float zb[kTokens * kDecodeStreamMaxRank];  // this block's partial X V
  __shared__ __align__(16) unsigned char stage[kWarps][512];
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int M = p.M, K = p.K, r = p.r, rp = (r + 15) / 16 * 16;
  const int warp = threadIdx.x / 32;
  const int k_per_block = (K + cs * kChunk - 1) / (cs * kChunk) * kChunk;
  const SliceProjection<T, NT> proj(p, rank * k_per_block, min(K, (rank + 1) * k_per_block), stage[warp]);

  uint4 a0[kProjectBatch], a1[kProjectBatch], v[kProjectBatch];
  auto load_batch = [&](int q0) {  // every load of the batch before the first mma
#pragma unroll
    for (int i = 0; i < kProjectBatch; ++i) proj.load(q0 + i * proj.kparts, a0[i], a1[i], v[i]);
  };
  float z[4] = {0.f, 0.f, 0.f, 0.f};
  if (proj.live) load_batch(proj.kp);
  // The stream may start once this block's first loads are on their way: its copies of W, requested
  // by the whole grid at once, then queue behind them.
  launch_dependents();
  if (proj.live) {
    for (int q0 = proj.kp;;) {
#pragma unroll
      for (int i = 0; i < kProjectBatch; ++i) proj.mma(z, a0[i], a1[i], v[i]);
      q0 += kProjectBatch * proj.kparts;
      if (q0 >= proj.nchunks) break;
      load_batch(q0);
    }
    proj.store(zpart + warp * kPartFloats, z);
  }
  __syncthreads();
  for (int i = threadIdx.x; i < M * r; i += kThreads)
    zb[(i / r) * kDecodeStreamMaxRank + i % r] = proj.block_sum(zpart, i / r, i % r);
  cluster.sync();  // every block's partial X V is complete and visible to the cluster

  // The cluster's sum in a fixed order, its elements spread over the cluster's blocks.
  const T* codes = static_cast<const T*>(p.codes);
  T* Pc = static_cast<T*>(p.Pc);
  for (int i = rank * kThreads + threadIdx.x; i < M * rp; i += cs * kThreads) {
    const int m = i / rp, jj = i % rp;
    float pc = 0.f;
    if (jj < r) {
      const float sum = cluster_sum<kDecodeStreamMaxCluster>(cluster, zb, m * kDecodeStreamMaxRank + jj, cs);
      if (p.P) p.P[m * r + jj] = sum;
      pc = sum * p.scale * (codes ? to_acc(codes[m * r + jj]) : 1.f);
    }
    Pc[i] = from_acc<T>(pc);  // rounded to the input dtype, as PyTorch rounds it
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

// ---- host side: the split-K grid the streaming and TMA kernels share ----

// Row tiles of `rows` along x, the K split's thread-block cluster along y; after_projection: a programmatic
// dependent launch (it may start while the projection launch before it still runs). `attribute` holds two
// entries and must outlive the launch.
inline cudaLaunchConfig_t split_k_config(const DecodeArgs& a, int rows, int threads, cudaLaunchAttribute* attribute,
                                         cudaStream_t stream, int smem_bytes, bool after_projection) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.N + rows - 1) / rows, a.split_k, 1);
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = a.split_k;
  attribute[0].val.clusterDim.z = 1;
  attribute[1].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute[1].val.programmaticStreamSerializationAllowed = 1;
  config.attrs = attribute;
  config.numAttrs = after_projection ? 2 : 1;
  return config;
}

// Clusters of `cs` blocks of Kernel resident at once on `device` (common.cuh's resident_clusters_of).
template <auto Kernel>
int split_k_resident_clusters(int cs, int device, int rows, int threads, int smem_bytes) {
  return resident_clusters_of((const void*)Kernel, device, cs, [=](cudaLaunchConfig_t& config,
                                                                   cudaLaunchAttribute* attribute) {
    const cudaError_t err = raise_smem_limit<Kernel>(smem_bytes);
    DecodeArgs probe{};
    probe.N = rows;
    probe.split_k = cs;
    config = split_k_config(probe, rows, threads, attribute, nullptr, smem_bytes, false);
    return err;
  });
}

}  // namespace
}  // namespace bem
