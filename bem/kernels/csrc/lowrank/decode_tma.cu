// The BEM linear at decode sizes on Hopper with W brought in by TMA and multiplied by wgmma (sm_90a,
// W row-major, M <= 16 tokens, K a multiple of 8, r <= 64):
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// The streaming kernel (decode_stream.cu) has every thread copy its own 16-byte pieces of W: at 16 tokens
// on the MLP's shapes it reached 45-48% of DRAM bandwidth, issuing 3-5x cuBLAS's instructions per byte and
// waiting on its loads' scoreboards. Here one thread of a producer warp requests a whole stage of W (128 rows
// x 64 columns, 16 KB, one tensor-map copy in the 128-byte swizzle) and X's 64 columns for the same stage, and
// a ring of stages keeps up to kStages of those in flight a block; the four warps of the consumer warpgroup
// only wait on each stage's mbarrier and multiply it on the tensor cores (wgmma m64 x tokens x k16, W's rows
// as the m side, X's tokens as the n side), then hand the stage back.
//
// A block owns 128 rows of W over one slice of K; the CS blocks that share those rows form a thread-block
// cluster and sum their partial results through distributed shared memory in a fixed order, as the
// streaming kernel does (deterministic, no workspace). The update's X V comes from the projection launch
// before this one (decode_project_kernel: Pc = s (X V) ⊙ c); the first block of each cluster adds Pc U^T to
// its rows half-way through its slice, with mma.sync on the wgmma accumulators (whose layout for 16 rows x 8
// tokens is mma.sync's).

#include <type_traits>

#include "decode_projection.cuh"
#include "tma.cuh"
#include "wgmma.cuh"

namespace bem {
namespace {

constexpr int kTmaRows = 128;                     // rows of W a block: two m64 wgmma tiles
constexpr int kTmaBK = 64;                        // columns of K a stage: one 128-byte swizzled row
constexpr int kTmaConsumers = 128;                // one warpgroup
constexpr int kTmaThreads = kTmaConsumers + 32;   // and the producer warp
constexpr int kTmaStages = 4;
constexpr int kTmaYLd = kTmaRows + 4;

template <int NTOK> struct TmaDecodeLayout {
  static constexpr int w_bytes = kTmaRows * kTmaBK * 2;  // 16 KB
  static constexpr int x_bytes = NTOK * kTmaBK * 2;      // whole 1024-byte swizzle groups (NTOK 8 or 16)
  static constexpr int stage_bytes = w_bytes + x_bytes;
  static constexpr int barrier_offset = kTmaStages * stage_bytes;
  static constexpr int total_bytes = barrier_offset + 2 * kTmaStages * 8 + 1024;  // + alignment slack
  static_assert(stage_bytes % 1024 == 0, "each stage starts on a 1024-byte swizzle group");
  static_assert(NTOK * kTmaYLd * 4 <= barrier_offset, "the partial results reuse the ring's bytes");
};

// NTOK: tokens as wgmma's n (8: M <= 8, 16: M <= 16); RS: the update's k16 steps (ranks up to 16 RS).
template <typename T, int NTOK, int RS>
__global__ void __launch_bounds__(kTmaThreads, 3)
    decode_tma_kernel(const __grid_constant__ CUtensorMap w_map, const __grid_constant__ CUtensorMap x_map,
                      DecodeArgs p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Lay = TmaDecodeLayout<NTOK>;
  constexpr int kTok8 = NTOK / 8;  // 8-token column blocks of the accumulators
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const unsigned base = smem_address(smem);
  float* ys = reinterpret_cast<float*>(smem);  // after the ring is done: partial X W^T + update, [token][row]
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int tid = threadIdx.x;
  const int n0 = blockIdx.x * kTmaRows;
  const int k_begin = rank * p.k_per_split;
  const int k_end = min(K, k_begin + p.k_per_split);
  const int stages = k_end > k_begin ? (k_end - k_begin + kTmaBK - 1) / kTmaBK : 0;
  const unsigned full_bar = base + Lay::barrier_offset, empty_bar = full_bar + 8 * kTmaStages;

  if (tid == 0) {
    for (int s = 0; s < kTmaStages; ++s) {
      mbarrier_init(full_bar + 8 * s, 1);
      mbarrier_init(empty_bar + 8 * s, kTmaConsumers / 32);  // one arrival per consumer warp
    }
    fence_mbarrier_init();
  }
  __syncthreads();

  float acc[2][NTOK / 2];  // rows 64 h + 16 warp + g (+ 8) x tokens, wgmma's layout (wgmma.cuh)
#pragma unroll
  for (int h = 0; h < 2; ++h)
#pragma unroll
    for (int i = 0; i < NTOK / 2; ++i) acc[h][i] = 0.f;

  if (tid >= kTmaConsumers) {
    // The producer: one thread requests every stage. Columns past K (the last slice's last stage) and rows
    // past N or M come in as zeros.
    if (tid == kTmaConsumers) {
      for (int it = 0; it < stages; ++it) {
        const int s = it % kTmaStages, round = it / kTmaStages;
        if (round > 0) mbarrier_wait(empty_bar + 8 * s, (round - 1) & 1);
        const unsigned bar = full_bar + 8 * s, stage = base + s * Lay::stage_bytes;
        mbarrier_expect_bytes(bar, Lay::stage_bytes);
        const int k = k_begin + it * kTmaBK;
        tma_load_2d(stage, &w_map, k, n0, bar);
        tma_load_2d(stage + Lay::w_bytes, &x_map, k, 0, bar);
      }
    }
  } else {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
    const bool adds_update = rank == 0;
    // The update's operands (first block of the cluster): U's fragments for this thread's rows of each
    // half, ranks 16 s + 2 c, + 1 and + 8, + 9, and Pc's for each 8-token block.
    uint32_t ua[2][RS][4], pcw[kTok8][RS][2];
    auto load_update = [&]() {
      wait_for_prerequisite();  // Pc is the projection launch's output
      const T* U = static_cast<const T*>(p.U);
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row0 = n0 + 64 * h + 16 * warp + g;
        const bool ok0 = row0 < N, ok1 = row0 + 8 < N;
        const T* u0 = U + (size_t)(ok0 ? row0 : 0) * r;
        const T* u1 = U + (size_t)(ok1 ? row0 + 8 : 0) * r;
#pragma unroll
        for (int s = 0; s < RS; ++s) {
          const int jj = 16 * s + 2 * c;
          ua[h][s][0] = u_pair(u0, ok0, jj, r);
          ua[h][s][1] = u_pair(u1, ok1, jj, r);
          ua[h][s][2] = u_pair(u0, ok0, jj + 8, r);
          ua[h][s][3] = u_pair(u1, ok1, jj + 8, r);
        }
      }
      const T* Pc = static_cast<const T*>(p.Pc);
      const int rp = (r + 15) / 16 * 16;
#pragma unroll
      for (int t = 0; t < kTok8; ++t)
#pragma unroll
        for (int s = 0; s < RS; ++s) {
          const bool ok = 8 * t + g < M;
          const uint32_t* pc = reinterpret_cast<const uint32_t*>(Pc + (size_t)(ok ? (8 * t + g) * rp + 16 * s + 2 * c : 0));
          pcw[t][s][0] = ok ? __ldcg(pc) : 0u;
          pcw[t][s][1] = ok ? __ldcg(pc + 4) : 0u;
        }
    };
    const int half = stages / 2;
    for (int it = 0; it < stages; ++it) {
      if (adds_update && it == half) load_update();  // arrives while the second half streams
      mbarrier_wait(full_bar + 8 * (it % kTmaStages), (it / kTmaStages) & 1);
      const unsigned stage = base + (it % kTmaStages) * Lay::stage_bytes;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kTmaBK / 16; ++ks) {  // k16 step ks starts 32 bytes into each swizzled row
        const uint64_t xd = wgmma_desc_sw128(stage + Lay::w_bytes + ks * 32);
        Wgmma<T, NTOK>::ss(acc[0], wgmma_desc_sw128(stage + ks * 32), xd);
        Wgmma<T, NTOK>::ss(acc[1], wgmma_desc_sw128(stage + 64 * 128 + ks * 32), xd);
      }
      wgmma_commit();
      wgmma_wait<1>();  // the previous stage's wgmma are done: it goes back to the producer
      if (it > 0 && lane == 0) mbarrier_arrive(empty_bar + 8 * ((it - 1) % kTmaStages));
    }
    wgmma_wait<0>();
    if (adds_update) {
      if (stages == 0) load_update();
      // acc += U[rows] Pc^T: accumulator values 4 t .. 4 t + 3 of a half are mma.sync's D for rows (g, g + 8)
      // x tokens (8 t + 2 c, + 1) of the warp's 16 rows.
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int t = 0; t < kTok8; ++t) {
          float d[4] = {acc[h][4 * t], acc[h][4 * t + 1], acc[h][4 * t + 2], acc[h][4 * t + 3]};
#pragma unroll
          for (int s = 0; s < RS; ++s)
            mma_16816<T>(d, ua[h][s][0], ua[h][s][1], ua[h][s][2], ua[h][s][3], pcw[t][s][0], pcw[t][s][1]);
#pragma unroll
          for (int e = 0; e < 4; ++e) acc[h][4 * t + e] = d[e];
        }
    }
  }
  __syncthreads();  // every stage has been read: ys takes the ring's bytes
  if (tid < kTmaConsumers) {
    const int warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
#pragma unroll
    for (int h = 0; h < 2; ++h)
#pragma unroll
      for (int i = 0; i < NTOK / 2; ++i) {
        const int row = 64 * h + 16 * warp + g + 8 * ((i / 2) % 2), m = 8 * (i / 4) + 2 * c + i % 2;
        ys[m * kTmaYLd + row] = acc[h][i];
      }
  }
  cluster.sync();  // every block's ys is complete and visible to the cluster

  // Block q of the cluster sums rows [q * rows, (q + 1) * rows) of the cluster's partial results, in a fixed order.
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  const int rows = kTmaRows / cs, row_begin = rank * rows;
  for (int i = tid; i < rows * M; i += kTmaThreads) {
    const int nl = row_begin + i % rows, m = i / rows, n = n0 + nl;
    if (n >= N) continue;
    float y = cluster_sum<kDecodeStreamMaxCluster>(cluster, ys, m * kTmaYLd + nl, cs);
    if (bias) y += to_acc(bias[n]);
    Y[(size_t)m * N + n] = from_acc<T>(y);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

template <typename T, int NTOK, int RS>
cudaError_t launch_tma(const DecodeArgs& a, cudaStream_t stream) {
  constexpr auto kernel = decode_tma_kernel<T, NTOK, RS>;
  constexpr int bytes = TmaDecodeLayout<NTOK>::total_bytes;
  cudaError_t err = raise_smem_limit<kernel>(bytes);
  if (err != cudaSuccess) return err;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  CUtensorMap w_map, x_map;
  if ((err = encode_map(&w_map, a.W, a.N, a.K, kTmaRows, bf16)) != cudaSuccess) return err;
  if ((err = encode_map(&x_map, a.X, a.M, a.K, NTOK, bf16)) != cudaSuccess) return err;
  const int blocks = project_blocks(a.K);
  cudaLaunchAttribute project_cluster;
  const cudaLaunchConfig_t project =
      cluster_launch_config(dim3(blocks, 1, 1), kThreads, 0, stream, blocks, project_cluster);
  err = cudaLaunchKernelEx(&project, decode_project_kernel<T, NTOK / 8>, a);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attribute[2];
  const cudaLaunchConfig_t config =
      split_k_config(a, kTmaRows, kTmaThreads, attribute, stream, bytes, /*after_projection=*/true);
  return cudaLaunchKernelEx(&config, kernel, w_map, x_map, a);
}

template <typename T, int NTOK>
cudaError_t launch_ranks(const DecodeArgs& a, cudaStream_t stream) {
  return a.r <= 16 ? launch_tma<T, NTOK, 1>(a, stream)
         : a.r <= 32 ? launch_tma<T, NTOK, 2>(a, stream)
                     : launch_tma<T, NTOK, 4>(a, stream);
}

int resident_clusters(int cs, int device) {
  return split_k_resident_clusters<decode_tma_kernel<__nv_bfloat16, 16, 1>>(cs, device, kTmaRows, kTmaThreads,
                                                                            TmaDecodeLayout<16>::total_bytes);
}

}  // namespace

bool decode_tma_fits(const DecodeArgs& a, int cc_major) {
  // The streaming kernel's limits are TMA's too: 16-byte aligned X and W, row pitches K % 8 == 0 (X's rows
  // contiguous: the binding's 2-D x).
  return decode_stream_fits(a, cc_major);
}

bool decode_tma_takes(int K) {
  // From K = 2048 up. H100, CUDA-graph replays, x F.linear, TMA (own split) against the streaming kernel: 16
  // tokens, 8960 -> 1536 1.11 / 1.21, 8192 -> 2048 1.07 / 1.19, 4096² 1.12 / 1.18, 3072 -> 9216 1.20 / 1.32,
  // 2048 -> 8192 1.34 / 1.37; 1 token, 8192 -> 2048 1.07 / 1.13. Below, no gain: 1536 -> 8960 1.31 / 1.29 (16
  // tokens), 1.22 / 1.19 (1 token).
  return K >= 2048;
}

int decode_tma_split(int N, int K, int device) {
  // The largest cluster (K split) whose grid runs in one wave, with at least two stages a block.
  const int tiles = (N + kTmaRows - 1) / kTmaRows;
  return largest_one_wave_cluster(K, 2 * kTmaBK, tiles, kDecodeStreamMaxCluster,
                                  [device](int cs) { return resident_clusters(cs, device); });
}

int decode_tma_k_per_split(int K, int split_k) {
  return (K + split_k * kTmaBK - 1) / (split_k * kTmaBK) * kTmaBK;
}

cudaError_t launch_decode_tma(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.split_k < 1 || args.split_k > kDecodeStreamMaxCluster || kTmaRows % args.split_k != 0 ||
      args.k_per_split % kTmaBK != 0 || (size_t)args.split_k * args.k_per_split < (size_t)args.K ||
      args.Pc == nullptr)
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return args.M <= 8 ? launch_ranks<T, 8>(args, stream) : launch_ranks<T, 16>(args, stream);
  });
}

}  // namespace bem
