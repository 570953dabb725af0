// The BEM linear at 1-16 tokens for a weight stored transposed, K x N row-major (GPT-2's Conv1D), on the tensor
// cores (sm_90):
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// mma.sync wants W's k pairs in a register, which a K x N layout keeps apart (N apart in memory). Each warp
// copies a chunk of 16 rows of K x the block's 64 columns (one 16-byte load per lane and row quarter) into its
// own shared-memory tile, rows padded to 144 bytes, and ldmatrix.trans hands out the pairs: eight m16n8k16
// products a chunk, tokens as the m side (rows past M are zeros). V (K x r, rank-contiguous) is the same layout
// and rides along in the same chunk, so X V accumulates beside X W^T. The chunk after the current one is in
// flight while the current one multiplies.
//
// A block owns 64 columns over a slice of K, its 8 warps taking every 8th chunk; the cs blocks that share the
// columns form a thread-block cluster and split K, and the end is the CUDA-core kernel's (decode_columns.cu):
// the warps' sums through shared memory, one cluster barrier, then each block sums the cluster's X V for itself
// and the cluster's partial X W^T for its 64 / cs columns in a fixed order, adds the update and the bias.

#include <cooperative_groups.h>

#include "../common/common.cuh"
#include "decode_columns_end.cuh"
#include "launchers.h"

namespace bem {
namespace {

namespace cg = cooperative_groups;

constexpr int kThreads = 256;
constexpr int kWarps = kThreads / 32;
constexpr int kCols = 64;              // columns a block: eight n8 tiles
constexpr int kChunk = 16;             // rows of K a warp multiplies at once
constexpr int kTok = 16;               // the mma's m: tokens, zeros past M
constexpr int kWPitch = kCols + 8;     // halves a tile row: 144 bytes, conflict-free for ldmatrix
constexpr int kMaxRank = kDecodeColumnsMmaMaxRank;

template <int RT> struct ColumnsMmaLayout {
  static constexpr int v_pitch = RT == 1 ? 8 : 24;  // halves: 16 and 48 bytes a row, conflict-free
  static constexpr int tile_halves = kChunk * kWPitch + kChunk * v_pitch;
  static constexpr int tiles_bytes = kWarps * tile_halves * 2;
  static constexpr int stage_bytes = kWarps * kTok * kCols * 4;  // the warps' X W^T sums, after the stream
  static constexpr int shared_bytes = tiles_bytes > stage_bytes ? tiles_bytes : stage_bytes;
};

// RT: the rank's n8 tiles (r = 8 RT).
template <typename T, int RT>
__global__ void __launch_bounds__(kThreads) decode_columns_mma_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Lay = ColumnsMmaLayout<RT>;
  __shared__ __align__(16) unsigned char shared[Lay::shared_bytes];  // the warps' tiles, then stage_y
  __shared__ float stage_z[kWarps][kTok][kMaxRank];
  __shared__ float yb[kTok][kCols];     // this block's partial X W^T (read by the cluster)
  __shared__ float zb[kTok][kMaxRank];  // this block's partial X V (read by the cluster)
  __shared__ float zc[kTok][kMaxRank];  // s (X V) ⊙ codes over the whole of K
  cg::cluster_group cluster = cg::this_cluster();
  const int rank = (int)cluster.block_rank();

  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* V = static_cast<const T*>(p.V);
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.y * kCols;
  const int k_begin = rank * p.k_per_split;
  const int k_end = min(K, k_begin + p.k_per_split);

  T* tile = reinterpret_cast<T*>(shared) + warp * Lay::tile_halves;
  T* vtile = tile + kChunk * kWPitch;
  // ldmatrix row addresses: lane l gives row l % 8 of matrix l / 8, matrices (k 0-7, k 8-15) x two n8 tiles.
  const int lrow = (lane / 8) % 2 * 8 + lane % 8, lcol = lane / 16 * 8;
  const unsigned w_address = smem_address(tile + lrow * kWPitch + lcol);
  const unsigned v_address = smem_address(vtile + lrow * Lay::v_pitch + (RT == 2 ? lcol : 0));

  // One chunk's operands in registers: W's 16 x 64 (four 16-byte pieces a lane), V's 16 x r (one piece a lane
  // of the first 16 RT lanes) and x's A fragments (tokens g, g + 8 x k pairs 2c and 2c + 8).
  uint4 w[4], v;
  uint32_t a[4];
  auto load = [&](int k) {
    const bool live = k < k_end;  // k_end and k are multiples of 8: an 8-row group is all in or all out
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = lane + 32 * i, row = idx / 8, col = n0 + 8 * (idx % 8);
      const bool in = live && k + row < k_end && col < N;
      w[i] = in ? ld_stream16(W + (size_t)(k + row) * N + col) : zero4();
    }
    const int vrow = lane / RT, vpart = lane % RT;
    const bool v_in = live && lane < kChunk * RT && k + vrow < k_end;
    v = v_in ? ld_cached16(V + (size_t)(k + vrow) * r + 8 * vpart) : zero4();
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int m = g + 8 * (i % 2), kk = k + 2 * c + 8 * (i / 2);
      a[i] = live && m < M && kk < k_end ? __ldg(reinterpret_cast<const unsigned*>(X + (size_t)m * K + kk)) : 0u;
    }
  };

  float acc[kCols / 8][4], z[RT][4];
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e) acc[j][e] = 0.f;
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) z[t][e] = 0.f;

  int k = k_begin + warp * kChunk;
  load(k);
  for (; k < k_end; k += kWarps * kChunk) {
    __syncwarp();  // every lane has read the last chunk's tile
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      const int idx = lane + 32 * i;
      *reinterpret_cast<uint4*>(tile + (idx / 8) * kWPitch + 8 * (idx % 8)) = w[i];
    }
    if (lane < kChunk * RT) *reinterpret_cast<uint4*>(vtile + (lane / RT) * Lay::v_pitch + 8 * (lane % RT)) = v;
    const uint32_t a0 = a[0], a1 = a[1], a2 = a[2], a3 = a[3];
    __syncwarp();
    load(k + kWarps * kChunk);  // the next chunk's loads fly while this one multiplies
#pragma unroll
    for (int jp = 0; jp < kCols / 16; ++jp) {
      const uint4 b = ldmatrix_x4_trans(w_address + jp * 16 * 2);
      mma_16816<T>(acc[2 * jp], a0, a1, a2, a3, b.x, b.y);
      mma_16816<T>(acc[2 * jp + 1], a0, a1, a2, a3, b.z, b.w);
    }
    if constexpr (RT == 1) {
      const uint2 b = ldmatrix_x2_trans(v_address);
      mma_16816<T>(z[0], a0, a1, a2, a3, b.x, b.y);
    } else {
      const uint4 b = ldmatrix_x4_trans(v_address);
      mma_16816<T>(z[0], a0, a1, a2, a3, b.x, b.y);
      mma_16816<T>(z[1], a0, a1, a2, a3, b.z, b.w);
    }
  }

  // ---- The block's sums: the 8 warps' partials through shared memory, in warp order ----
  __syncthreads();  // every warp is done with its tile: stage_y takes the tiles' bytes
  auto stage_y = reinterpret_cast<float (*)[kTok][kCols]>(shared);  // [warp][token][column]
#pragma unroll
  for (int j = 0; j < kCols / 8; ++j)
#pragma unroll
    for (int e = 0; e < 4; ++e)
      stage_y[warp][g + 8 * (e / 2)][8 * j + 2 * c + e % 2] = acc[j][e];
#pragma unroll
  for (int t = 0; t < RT; ++t)
#pragma unroll
    for (int e = 0; e < 4; ++e) stage_z[warp][g + 8 * (e / 2)][8 * t + 2 * c + e % 2] = z[t][e];
  __syncthreads();
  columns_block_sums<kThreads, kWarps>(M, 8 * RT, stage_y, stage_z, yb, zb);
  columns_cluster_end<T, kThreads>(cluster, p, n0, yb, zb, zc);
#endif
}

template <typename T>
auto columns_mma_kernel(int r) {
  return r <= 8 ? decode_columns_mma_kernel<T, 1> : decode_columns_mma_kernel<T, 2>;
}

int resident_clusters(int cs, int r, int device) {
  const void* kernel = (const void*)columns_mma_kernel<__nv_bfloat16>(r);
  return resident_clusters_of(kernel, device, cs, [cs](cudaLaunchConfig_t& config, cudaLaunchAttribute* attribute) {
    config = cluster_launch_config(dim3(cs, 1, 1), kThreads, 0, nullptr, cs, attribute[0]);
    return cudaSuccess;
  });
}

}  // namespace

bool decode_columns_mma_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && a.w_transposed && a.M >= 1 && a.M <= kDecodeColumnsMmaMaxTokens && a.K >= 8 &&
         a.K % 8 == 0 && a.N % 8 == 0 && a.r % 8 == 0 && a.r >= 8 && a.r <= kDecodeColumnsMmaMaxRank &&
         aligned16(a.W) && aligned16(a.X) && aligned16(a.V);
}

int decode_columns_mma_split(int N, int K, int r, int device) {
  // The largest cluster (K split) whose grid runs in one wave with a chunk of 16 rows for every warp of a block.
  const int tiles = (N + kCols - 1) / kCols;
  return largest_one_wave_cluster(K, kWarps * kChunk, tiles, kDecodeStreamMaxCluster,
                                  [=](int cs) { return resident_clusters(cs, r, device); });
}

int decode_columns_mma_k_per_split(int K, int split_k) {
  return (K + split_k * kChunk - 1) / (split_k * kChunk) * kChunk;
}

cudaError_t launch_decode_columns_mma(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.split_k < 1 || args.split_k > kDecodeStreamMaxCluster || (args.split_k & (args.split_k - 1)) != 0 ||
      args.k_per_split % kChunk != 0 || (size_t)args.split_k * args.k_per_split < (size_t)args.K)
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    cudaLaunchAttribute attribute;
    const dim3 grid(args.split_k, (args.N + kCols - 1) / kCols, 1);
    const cudaLaunchConfig_t config = cluster_launch_config(grid, kThreads, 0, stream, args.split_k, attribute);
    return cudaLaunchKernelEx(&config, columns_mma_kernel<T>(args.r), args);
  });
}

}  // namespace bem
