// The generated update s * ((A B) ⊙ codes) U^T at prefill sizes, streaming A once and Y once.
//
// A block owns 16 MT rows (tokens) and 8 NT ranks (r rounded up to 8, 16, 32 or 64). Phase 1: its 8
// warps split K into contiguous runs, each projecting its run for every token tile (lowrank_project.cuh:
// A streamed straight into tensor-core registers, B's rows through a per-warp staging tile). The 8 partial products meet once in shared memory and are summed
// in a fixed order into s P ⊙ c, stored in A's dtype as plain PyTorch rounds it. Phase 2 computes
// Y^T tiles as U · (s P ⊙ c)^T: two 4-byte loads per 16 ranks of each of U's rows (the A operand) serve
// all the block's tokens, whose fragments stay in registers. Column tiles of 32 are interleaved across
// the warps (a block writes whole row runs) and go out through a per-warp staging buffer as 16-byte
// stores.
//
// With few rows (a few hundred tokens: too few blocks for the GPU) the blocks of a thread-block cluster
// (sm_90) share a group of tokens: each takes a slice of K in phase 1, their partial products are summed
// in a fixed order through distributed shared memory, and each then expands its own slice of Y's columns.
#include <cooperative_groups.h>

#include "../common/common.cuh"
#include "launchers.h"
#include "lowrank_project.cuh"

namespace bem {
namespace {

constexpr int kWarps = 8, kThreads = 256, kColTile = 32;

struct StreamFlags {
  bool expand, accumulate, y_vec;
};

template <int MT, int NT> struct StreamShape {
  static constexpr int tokens = 16 * MT, ranks = 8 * NT;
  static constexpr int ksteps = (ranks + 15) / 16;         // phase 2's k16 steps over the ranks
  static constexpr int z_ld = ranks + 1;                   // fp32 partials: odd stride spreads the banks
  static constexpr int z_floats = kWarps * tokens * z_ld;
  static constexpr int y_ld = kColTile + 4;
  static constexpr int y_floats = kWarps * 16 * y_ld;     // per warp: 16 tokens x 32 columns
  static constexpr int pc_ld = ranks + 2;                  // s P ⊙ c in A's dtype, one row per token
  static constexpr size_t pc_offset = (size_t)cmax(z_floats, y_floats) * 4;
  static constexpr size_t stage_offset = (pc_offset + (size_t)tokens * pc_ld * 2 + 15) / 16 * 16;  // B's
  // the block's partial P (summed over its warps), read by the cluster's other blocks (clusters only)
  static constexpr size_t zsum_offset = stage_offset + (size_t)kWarps * kProjectStageBytes;
  static constexpr size_t smem_bytes(bool cluster) {
    return cluster ? zsum_offset + (size_t)tokens * ranks * 4 : zsum_offset;
  }
};

// Cluster barrier halves (sm_90). Publishing the partial P needs release and acquire; the later arrival
// only says that this block's reads of the others' shared memory are done (their values are already in
// registers), so it is relaxed: a release there waited for the block's global stores of P.
__device__ __forceinline__ void cluster_arrive_release() {
  asm volatile("barrier.cluster.arrive.release.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_arrive_relaxed() {
  asm volatile("barrier.cluster.arrive.relaxed.aligned;\n" ::: "memory");
}
__device__ __forceinline__ void cluster_wait() { asm volatile("barrier.cluster.wait.acquire.aligned;\n" ::: "memory"); }

// CLUSTER: launched as clusters of gridDim.x blocks (sm_90), blockIdx.y the token group; otherwise one
// block per token group along x.
template <typename T, int MT, int NT, bool CLUSTER>
__global__ void __launch_bounds__(kThreads, 2) lowrank_stream_kernel(LowRankArgs a, StreamFlags f) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  if constexpr (CLUSTER) return;  // never launched: the host asks for clusters on sm_90 only
  else {
#endif
  using S = StreamShape<MT, NT>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* zbuf = reinterpret_cast<float*>(smem_raw);  // phase 1's partials, then phase 2's staging
  T* pcs = reinterpret_cast<T*>(smem_raw + S::pc_offset);
  const T* A = static_cast<const T*>(a.A);
  const T* B = static_cast<const T*>(a.B);
  const T* codes = static_cast<const T*>(a.codes);
  const T* U = static_cast<const T*>(a.U);
  const T* bias = static_cast<const T*>(a.bias);
  T* Y = static_cast<T*>(a.Y);
  float* P = static_cast<float*>(a.P);
  const int M = a.M, L = a.L, N = a.N, r = a.r;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = (CLUSTER ? blockIdx.y : blockIdx.x) * S::tokens;
  const int slice = CLUSTER ? blockIdx.x : 0, slices = CLUSTER ? gridDim.x : 1;  // this block's slices of K and N

  // ---- Phase 1: this warp's share of the block's slice of K, for every token of the block ----
  const ChunkRange chunks = warp_chunks(L, slice, slices, warp, kWarps);
  unsigned char* stage = smem_raw + S::stage_offset + warp * kProjectStageBytes;
  // The codes of this thread's elements of the P sum below, requested now where they are few (kept raw:
  // converting them here would wait for the load before phase 1); with more, they would crowd phase 1's
  // registers and are read in the sum.
  constexpr int kSumPerThread = (S::tokens * S::ranks + kThreads - 1) / kThreads;
  constexpr bool kEarlyCodes = kSumPerThread <= 2;
  auto load_code = [&](int i) {
    const int e = threadIdx.x + i * kThreads, gm = m0 + e / S::ranks, j = e % S::ranks;
    return codes && e < S::tokens * S::ranks && gm < M && j < r ? codes[(size_t)gm * r + j] : from_acc<T>(1.f);
  };
  T code_raw[kSumPerThread];
  if constexpr (kEarlyCodes) {
#pragma unroll
    for (int i = 0; i < kSumPerThread; ++i) code_raw[i] = load_code(i);
  }

  float z[MT][NT][4] = {};
  project_chunks<T, MT, NT>(A, L, B, r, M, m0, chunks.begin, chunks.end, stage, z);
  store_partials<MT, NT>(zbuf + warp * S::tokens * S::z_ld, S::z_ld, z);
  __syncthreads();

  // ---- P summed over the warps (and the cluster's blocks) in a fixed order; s P ⊙ c to shared memory ----
  float* zsum = reinterpret_cast<float*>(smem_raw + S::zsum_offset);
  if constexpr (CLUSTER) {
    for (int e = threadIdx.x; e < S::tokens * S::ranks; e += kThreads) {
      const int tok = e / S::ranks, j = e % S::ranks;
      float sum = 0.f;
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += zbuf[(w * S::tokens + tok) * S::z_ld + j];
      zsum[e] = sum;
    }
    cluster_arrive_release();  // this block's partial P is published; the wait is after U's requests
  }

  // Phase 2's column tiles for this block, and U's fragments for this warp's first tile: requested now,
  // so that their latency passes while P is summed.
  const int all_tiles = (N + kColTile - 1) / kColTile, tiles_per_slice = (all_tiles + slices - 1) / slices;
  const int tile_begin = min(all_tiles, slice * tiles_per_slice);
  const int tiles = min(all_tiles, tile_begin + tiles_per_slice);  // this block's tiles: [tile_begin, tiles)
  // ua[sub][s]: U rows 16 sub + (g, g + 8) of tile t, ranks 16 s + 2c (+1) and + 8: the A fragment.
  auto load_u = [&](int t, uint32_t (&ua)[2][S::ksteps][4]) {
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int s = 0; s < S::ksteps; ++s)
#pragma unroll
        for (int part = 0; part < 4; ++part) {  // {row g lo, row g+8 lo, row g hi, row g+8 hi}
          const int n = t * kColTile + 16 * sub + g + 8 * (part % 2), j = 16 * s + 8 * (part / 2) + 2 * c;
          ua[sub][s][part] = t < tiles && n < N && j < r
                                 ? __ldg(reinterpret_cast<const unsigned int*>(U + (size_t)n * r + j)) : 0u;
        }
  };
  uint32_t ua[2][S::ksteps][4], ua_next[2][S::ksteps][4];
  // The bias of the 8 columns this lane writes in tile t (16-byte stores only), requested with U.
  auto load_bias = [&](int t) {
    const int gn = t * kColTile + (lane % 4) * 8;
    return f.y_vec && bias != nullptr && t < tiles && gn < N ? ld_cached16(bias + gn) : zero4();
  };
  uint4 bias8 = zero4(), bias8_next = zero4();
  if (f.expand) {
    load_u(tile_begin + warp, ua);
    bias8 = load_bias(tile_begin + warp);
  }

  if constexpr (CLUSTER) cluster_wait();  // every block's partial P is visible
#pragma unroll
  for (int i = 0; i < kSumPerThread; ++i) {
    const int e = threadIdx.x + i * kThreads;
    if (e >= S::tokens * S::ranks) break;
    const int tok = e / S::ranks, j = e % S::ranks, gm = m0 + tok;
    float sum = 0.f;
    if constexpr (CLUSTER) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
      cooperative_groups::cluster_group cluster = cooperative_groups::this_cluster();
      sum = cluster_sum<kStreamMaxCluster>(cluster, zsum, e, slices);
#endif
    } else {
#pragma unroll
      for (int w = 0; w < kWarps; ++w) sum += zbuf[(w * S::tokens + tok) * S::z_ld + j];
    }
    const bool valid = gm < M && j < r;
    if (valid && P != nullptr && e % slices == slice) P[(size_t)gm * r + j] = sum;  // blocks share the writes
    const float code = to_acc(kEarlyCodes ? code_raw[i] : load_code(i));
    pcs[tok * S::pc_ld + j] = from_acc<T>(valid ? static_cast<float>(a.scale) * sum * code : 0.f);
  }
  if constexpr (CLUSTER) cluster_arrive_relaxed();  // done with the other blocks' partials
  if (!f.expand) {
    if constexpr (CLUSTER) cluster_wait();
    return;
  }
  __syncthreads();  // s P ⊙ c is complete; the staging buffers below reuse the partials' memory

  // Phase 2's B fragments: pb[tt][s]: tokens 8 tt + g, ranks 16 s + 2c (+1) and 16 s + 8 + 2c (+1).
  uint32_t pb[S::tokens / 8][S::ksteps][2];
#pragma unroll
  for (int tt = 0; tt < S::tokens / 8; ++tt)
#pragma unroll
    for (int s = 0; s < S::ksteps; ++s) {
      const T* row = pcs + (8 * tt + g) * S::pc_ld + 16 * s + 2 * c;
      pb[tt][s][0] = *reinterpret_cast<const uint32_t*>(row);
      pb[tt][s][1] = 16 * s + 8 < S::ranks ? *reinterpret_cast<const uint32_t*>(row + 8) : 0u;
    }

  // ---- Phase 2: Y^T[32-column tile, tokens] = U[tile] · (s P ⊙ c)^T, tiles interleaved across the warps ----
  float* ys = zbuf + warp * 16 * S::y_ld;
  for (int t = tile_begin + warp; t < tiles; t += kWarps) {
    const int n0 = t * kColTile;
    load_u(t + kWarps, ua_next);  // the next tile's U (and bias) is in flight while this one computes
    bias8_next = load_bias(t + kWarps);
#pragma unroll
    for (int tg = 0; tg < MT; ++tg) {  // 16 tokens at a time through the staging buffer
      float d[2][2][4] = {};
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int s = 0; s < S::ksteps; ++s)
#pragma unroll
          for (int tt = 0; tt < 2; ++tt)
            mma_16816<T>(d[sub][tt], ua[sub][s][0], ua[sub][s][1], ua[sub][s][2], ua[sub][s][3],
                         pb[2 * tg + tt][s][0], pb[2 * tg + tt][s][1]);
      // d[sub][tt]: columns 16 sub + (g, g + 8) x tokens 16 tg + 8 tt + (2c, 2c + 1)
#pragma unroll
      for (int sub = 0; sub < 2; ++sub)
#pragma unroll
        for (int tt = 0; tt < 2; ++tt) {
          const int col = 16 * sub + g, tok = 8 * tt + 2 * c;
          ys[tok * S::y_ld + col] = d[sub][tt][0];
          ys[(tok + 1) * S::y_ld + col] = d[sub][tt][1];
          ys[tok * S::y_ld + col + 8] = d[sub][tt][2];
          ys[(tok + 1) * S::y_ld + col + 8] = d[sub][tt][3];
        }
      __syncwarp();
      const int row0 = m0 + 16 * tg;
      if (f.y_vec) {
        // 16 rows x 4 groups of 8 columns: lane l writes rows l / 4 and l / 4 + 8, columns 8 (l % 4).
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int row = lane / 4 + 8 * h, col = (lane % 4) * 8, gm = row0 + row, gn = n0 + col;
          if (gm >= M || gn >= N) continue;
          const float4 lo = *reinterpret_cast<const float4*>(ys + row * S::y_ld + col);
          const float4 hi = *reinterpret_cast<const float4*>(ys + row * S::y_ld + col + 4);
          float v[8] = {lo.x, lo.y, lo.z, lo.w, hi.x, hi.y, hi.z, hi.w};
          float b[8];
          unpack8<T>(bias8, b);  // zeros without a bias
#pragma unroll
          for (int e = 0; e < 8; ++e) v[e] += b[e];
          store8<T>(Y + (size_t)gm * N + gn, v, nullptr, f.accumulate);
        }
      } else {
        for (int i = lane; i < 16 * kColTile; i += 32) {
          const int row = i / kColTile, col = i % kColTile, gm = row0 + row, gn = n0 + col;
          if (gm >= M || gn >= N) continue;
          float v = ys[row * S::y_ld + col];
          if (bias) v += to_acc(bias[gn]);
          T* dst = Y + (size_t)gm * N + gn;
          if (f.accumulate) v += to_acc(*dst);
          *dst = from_acc<T>(v);
        }
      }
      __syncwarp();  // the staging buffer is rewritten by the next 16 tokens
    }
#pragma unroll
    for (int sub = 0; sub < 2; ++sub)
#pragma unroll
      for (int s = 0; s < S::ksteps; ++s)
#pragma unroll
        for (int part = 0; part < 4; ++part) ua[sub][s][part] = ua_next[sub][s][part];
    bias8 = bias8_next;
  }
  if constexpr (CLUSTER) cluster_wait();  // no block exits while another may still read its partial P
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ < 900
  }
#endif
}

template <typename T, int MT, int NT>
cudaError_t launch_typed(const LowRankArgs& a, cudaStream_t stream) {
  static_assert(MT * NT <= 16, "the partial products would not fit in registers and shared memory");
  using S = StreamShape<MT, NT>;
  StreamFlags f;
  f.expand = a.expand;
  f.accumulate = a.accumulate;
  f.y_vec = a.expand && a.N % 8 == 0 && aligned16(a.Y) && (a.bias == nullptr || aligned16(a.bias));
  const int groups = (a.M + S::tokens - 1) / S::tokens;
  const int cs = lowrank_stream_cluster(a);
  if (cs == 1) {
    const cudaError_t err = raise_smem_limit<lowrank_stream_kernel<T, MT, NT, false>>((int)S::smem_bytes(false));
    if (err != cudaSuccess) return err;
    lowrank_stream_kernel<T, MT, NT, false><<<groups, kThreads, S::smem_bytes(false), stream>>>(a, f);
    return cudaGetLastError();
  }
  const cudaError_t err = raise_smem_limit<lowrank_stream_kernel<T, MT, NT, true>>((int)S::smem_bytes(true));
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute cluster;
  const cudaLaunchConfig_t config =
      cluster_launch_config(dim3(cs, groups, 1), kThreads, S::smem_bytes(true), stream, cs, cluster);
  return cudaLaunchKernelEx(&config, lowrank_stream_kernel<T, MT, NT, true>, a, f);
}

template <typename T, int MT>
cudaError_t launch_ranks(const LowRankArgs& a, cudaStream_t stream) {
  if (a.r <= 8) return launch_typed<T, MT, 1>(a, stream);
  if (a.r <= 16) return launch_typed<T, MT, 2>(a, stream);
  if (a.r <= 32) return launch_typed<T, MT, 4>(a, stream);
  if constexpr (MT <= 2) return launch_typed<T, MT, 8>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_tokens(const LowRankArgs& a, cudaStream_t stream) {
  switch (lowrank_stream_tokens(a)) {
    case 16: return launch_ranks<T, 1>(a, stream);
    case 32: return launch_ranks<T, 2>(a, stream);
    case 64: return launch_ranks<T, 4>(a, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace

bool lowrank_stream_fits(const LowRankArgs& a) {
  // 16-byte loads of A's rows (L % 8) and B's (r % 8), 4-byte loads of U's rank pairs.
  const bool tokens_ok = a.stream_tokens == 0 || a.stream_tokens == 16 || a.stream_tokens == 32 ||
                         (a.stream_tokens == 64 && a.r <= kStreamTallBlockMaxRank);
  const int cs = a.stream_cluster;
  const bool cluster_ok = cs == 0 || cs == 1 || ((cs == 2 || cs == 4 || cs == kStreamMaxCluster) && a.cc_major >= 9);
  return a.L % 8 == 0 && a.r % 8 == 0 && a.r >= 8 && a.r <= kStreamMaxRank && aligned16(a.A) && aligned16(a.B) &&
         (!a.expand || aligned16(a.U)) && a.P_in == nullptr && tokens_ok && cluster_ok;
}

int lowrank_stream_cluster(const LowRankArgs& a) {
  if (a.stream_cluster != 0) return a.stream_cluster;
  if (a.cc_major < 9 || a.r > kStreamClusterMaxRank) return 1;
  // The smallest cluster that gives 7/8 of the multiprocessors a block, each block keeping at least
  // kStreamClusterMinK columns of K. Measured on an H200 (update alone, 4096², r = 8, blocks of 16
  // tokens, docs/kernels.md): M = 1024 10.4 us with 2 blocks a group (128 blocks) against 14.8 with 1
  // and 14.0 with 4; M = 512 9.5 us with 4 against 11.7 with 8; M = 32 6.0 us with 8.
  const long long groups = (a.M + lowrank_stream_tokens(a) - 1) / lowrank_stream_tokens(a);
  const long long wanted = a.num_sms - a.num_sms / 8;
  int cs = 1;
  while (cs < kStreamMaxCluster && groups * cs < wanted && a.L >= 2 * cs * kStreamClusterMinK) cs *= 2;
  return cs;
}

int lowrank_stream_tokens(const LowRankArgs& a) {
  if (a.stream_tokens != 0) return a.stream_tokens;
  // The most tokens per block (each B and U load serves them all) that still gives every
  // multiprocessor two blocks; 64 only up to rank 32 (registers).
  const int wanted_blocks = 2 * (a.num_sms > 0 ? a.num_sms : 1);
  for (int tokens : {64, 32}) {
    if (tokens == 64 && a.r > kStreamTallBlockMaxRank) continue;
    if ((a.M + tokens - 1) / tokens >= wanted_blocks) return tokens;
  }
  return 16;
}

cudaError_t launch_lowrank_stream(DType dtype, const LowRankArgs& args, cudaStream_t stream) {
  if (!lowrank_stream_fits(args)) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_tokens<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
