// The BEM linear at decode sizes (M <= 16 tokens, Hopper) in one launch that streams W once:
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// Decode is a read of W and nothing else, so the kernel is built around that read: every thread keeps
// its own ring of 16-byte cp.async copies of W in flight (kStages chunks deep) and reads back only
// what it copied, so no barrier ever stalls the stream; each copy is already in the layout of a
// tensor-core operand (see the k-map note in common.cuh), and rows are read in long contiguous runs.
// A block owns 128 rows of W over one slice of K; the CS blocks that share those rows form a
// thread-block cluster. Since the update is linear in X V, each block adds its own share
// s ((X V)_slice ⊙ c) U^T to its rows, and it does so first: the first loads of its X V are requested
// before any of W (so they do not queue behind the whole grid's W requests), then the ring's first
// kStages - 1 chunks, and the update's mma and short chain of barriers run while those are on their
// way; they also leave the block's x in L1 for the stream's loop. After the stream and one
// cluster barrier, block q of the cluster sums the CS partial results for its 128/CS rows through
// distributed shared memory in a fixed order (deterministic, no workspace, no counters), adds b and
// writes Y.
#include <cooperative_groups.h>

#include <map>
#include <mutex>
#include <utility>

#include "common.cuh"
#include "launchers.h"

namespace bem {
namespace {

namespace cg = cooperative_groups;

constexpr int kRows = 128;    // rows of W per block: 16 per warp
constexpr int kThreads = 256; // 8 warps
constexpr int kWarps = kThreads / 32;
constexpr int kChunk = 32;    // k per 16-byte load across the 4 threads of a row
// Chunks of W in flight per thread (2 x 16 bytes each). Five, not more: the ring's shared memory is
// taken from L1, and the stream's loop reads x from L1 (16 tokens: 16 KB a block). On an H200, 8, 7,
// 6 and 5 stages gave M = 16, 4096², r = 8: 1.30, 1.26, 1.24, 1.20x F.linear; M = 1: 1.14 -> 1.10x.
constexpr int kStages = 5;
constexpr int kEarlyChunks = 2;  // chunks of a warp's X V job whose operands are requested before W
constexpr int kTokens = kDecodeStreamMaxTokens;
constexpr int kRankSteps = kDecodeStreamMaxRank / 16;  // k16 steps of the update's mma
constexpr int kYLd = kRows + 4;
// Dynamic shared memory: the ring, then the update's buffers (live while W streams); the partial
// X W^T (ys, read by the cluster at the end) reuses the ring's bytes once the stream is done.
constexpr int kRingBytes = kStages * 2 * kThreads * 16;
constexpr int kZpartOffset = kRingBytes;                                        // float [8 jobs][16][8]
constexpr int kZbOffset = kZpartOffset + kWarps * kTokens * 8 * 4;              // float [16][r]
constexpr int kZcOffset = kZbOffset + kTokens * kDecodeStreamMaxRank * 4;  // T [16][r padded to 16]
constexpr int kSmemBytes = kZcOffset + kTokens * kDecodeStreamMaxRank * 2;
static_assert(kTokens * kYLd * 4 <= kRingBytes, "ys must fit in the ring's bytes");

// U[row][j], U[row][j + 1] as one mma operand word, zeros past the rank or outside the matrix.
template <typename T>
__device__ __forceinline__ uint32_t u_pair(const T* u_row, bool row_ok, int j, int r) {
  const T zero = from_acc<T>(0.f);
  return pack2(row_ok && j < r ? u_row[j] : zero, row_ok && j + 1 < r ? u_row[j + 1] : zero);
}

// The fixed-order sum over the cluster's CS blocks of buf[i] in each block's shared memory; every remote
// read is issued before the first add, so their latencies overlap.
__device__ __forceinline__ float cluster_sum(cg::cluster_group& cluster, float* buf, int i, int cs) {
  float part[kDecodeStreamMaxCluster];
#pragma unroll
  for (int s = 0; s < kDecodeStreamMaxCluster; ++s) part[s] = s < cs ? cluster.map_shared_rank(buf, s)[i] : 0.f;
  float sum = part[0];
#pragma unroll
  for (int s = 1; s < kDecodeStreamMaxCluster; ++s)
    if (s < cs) sum += part[s];
  return sum;
}

template <typename T, int NT>
__global__ void __launch_bounds__(kThreads, 3) decode_stream_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);                    // [stage][row g | g + 8][thread]
  float* ys = reinterpret_cast<float*>(smem);                      // after the stream: partial X W^T + update
  float* zpart = reinterpret_cast<float*>(smem + kZpartOffset);    // per-warp partial X V fragments
  float* zb = reinterpret_cast<float*>(smem + kZbOffset);          // this block's partial X V (M x r)
  T* zc = reinterpret_cast<T*>(smem + kZcOffset);                  // s * zb ⊙ c as mma operands, 0-padded
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();

  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* V = static_cast<const T*>(p.V);
  const T* U = static_cast<const T*>(p.U);
  const T* codes = static_cast<const T*>(p.codes);
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int tid = threadIdx.x;
  const int n0 = blockIdx.x * kRows;
  const int k_begin = rank * p.k_per_split;
  const int k_end = min(K, k_begin + p.k_per_split);
  const int nchunks = k_end > k_begin ? (k_end - k_begin + kChunk - 1) / kChunk : 0;
  const int rp = (r + 15) / 16 * 16;  // rank padded to the mma's k16

  // This thread's operand rows: tokens g and g + 8, rows g and g + 8 of the warp's 16 rows of W.
  const bool x_ok0 = g < M, x_ok1 = g + 8 < M;
  const T* x0 = X + (size_t)(x_ok0 ? g : 0) * K + 8 * c;
  const T* x1 = X + (size_t)(x_ok1 ? g + 8 : 0) * K + 8 * c;
  const int row0 = n0 + warp * 16 + g;
  const bool w_ok0 = row0 < N, w_ok1 = row0 + 8 < N;
  const T* w0 = W + (size_t)(w_ok0 ? row0 : 0) * K + 8 * c;
  const T* w1 = W + (size_t)(w_ok1 ? row0 + 8 : 0) * K + 8 * c;

  auto issue = [&](int q) {  // chunk q's two W fragments of this thread into its ring slot
    const int k = k_begin + q * kChunk, slot = q % kStages;
    const bool in = q < nchunks && k + 8 * c < k_end;  // K % 8 == 0: a group of 8 is all in or all out
    cp_async16(&ring[(slot * 2) * kThreads + tid], in && w_ok0 ? w0 + k : W, in && w_ok0);
    cp_async16(&ring[(slot * 2 + 1) * kThreads + tid], in && w_ok1 ? w1 + k : W, in && w_ok1);
  };
  auto load_x = [&](int q, uint4& xa, uint4& xb) {
    const int k = k_begin + q * kChunk;
    const bool in = q < nchunks && k + 8 * c < k_end;
    xa = in && x_ok0 ? ld_cached16(x0 + k) : zero4();
    if constexpr (NT == 2) xb = in && x_ok1 ? ld_cached16(x1 + k) : zero4();
  };

  // ---- The update's share: X V over this block's slice, tokens as the m16 rows, 8 ranks per n8 tile ----
  // Each warp takes one job: a rank tile, over every kparts-th chunk while there are fewer tiles than
  // warps. The operands of its first kEarlyChunks chunks are requested before W, so they do not queue
  // behind it.
  const int jtiles = (r + 7) / 8;
  const int kparts = kWarps / jtiles;
  const bool xv_warp = warp < jtiles * kparts;
  const int jt = warp / kparts, kp = warp % kparts;
  const int j = jt * 8 + g;
  // V is K x r, rank-contiguous, while an mma B operand holds pairs along k: thread (g, c) needs V's
  // k = 8c..8c+7 (its x fragment's k) at rank j. Where V's rows are 16-byte aligned (r % 8 == 0), each
  // lane loads one k-row of the warp's 8-rank tile in one 16-byte load and a per-warp staging tile with
  // ldmatrix.trans hands out the operands; otherwise each thread loads its 8 values one by one.
  const bool v_rows = r % 8 == 0 && (reinterpret_cast<uintptr_t>(V) & 15) == 0;
  auto load_v = [&](int q, bool live) -> uint4 {  // one chunk's V: the staged row, or the 4 operand words
    const int k = k_begin + q * kChunk;
    if (v_rows) {
      const bool in = live && q < nchunks && k + lane < k_end;
      return in ? ld_cached16(V + (size_t)(k + lane) * r + 8 * jt) : zero4();
    }
    const bool in = live && q < nchunks && k + 8 * c < k_end && j < r;
    const T* vp = V + (in ? (size_t)(k + 8 * c) * r + j : 0);
    T v[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] = in ? vp[(size_t)e * r] : from_acc<T>(0.f);
    return make_uint4(pack2(v[0], v[1]), pack2(v[2], v[3]), pack2(v[4], v[5]), pack2(v[6], v[7]));
  };
  uint4 pa0[kEarlyChunks], pa1[kEarlyChunks], pv[kEarlyChunks];
#pragma unroll
  for (int i = 0; i < kEarlyChunks; ++i) {
    const int q = kp + i * kparts;
    const int k = k_begin + q * kChunk;
    const bool in = xv_warp && q < nchunks && k + 8 * c < k_end;
    pa0[i] = in && x_ok0 ? ld_cached16(x0 + k) : zero4();
    pa1[i] = NT == 2 && in && x_ok1 ? ld_cached16(x1 + k) : zero4();  // NT == 1: M <= 8, no row g + 8
    pv[i] = load_v(q, xv_warp);
  }

  // ---- W starts streaming: the first kStages - 1 chunks of this thread's ring ----
#pragma unroll
  for (int q = 0; q < kStages - 1; ++q) {
    issue(q);
    cp_async_commit();
  }

  // U's fragments for this thread's rows (g, g + 8), loaded now so their latency overlaps X V's.
  const T* u0 = U + (size_t)(w_ok0 ? row0 : 0) * r;
  const T* u1 = U + (size_t)(w_ok1 ? row0 + 8 : 0) * r;
  uint32_t ua[kRankSteps][4];
#pragma unroll
  for (int s = 0; s < kRankSteps; ++s) {
    const int jj = 16 * s + 2 * c;  // ranks jj, jj + 1 and jj + 8, jj + 9: {row g lo, row g+8 lo, row g hi, row g+8 hi}
    const bool live = 16 * s < rp;
    ua[s][0] = live ? u_pair(u0, w_ok0, jj, r) : 0u;
    ua[s][1] = live ? u_pair(u1, w_ok1, jj, r) : 0u;
    ua[s][2] = live ? u_pair(u0, w_ok0, jj + 8, r) : 0u;
    ua[s][3] = live ? u_pair(u1, w_ok1, jj + 8, r) : 0u;
  }

  if (xv_warp) {
    // The staging tile is this warp's slice of zpart (512 bytes), free until the warp's results go there.
    // Lane L = 8c + 2t + u holds k-row L and stores it at row 8t + 2c + u, so that ldmatrix.trans gives
    // thread (g, c) the k pairs (8c + 2t, 8c + 2t + 1) of rank g as word t.
    unsigned char* stage = smem + kZpartOffset + warp * (kTokens * 8 * 4);
    const unsigned stage_address = static_cast<unsigned>(__cvta_generic_to_shared(stage)) + 16 * lane;
    uint4* stage_row = reinterpret_cast<uint4*>(stage) + 8 * ((lane % 8) / 2) + 2 * (lane / 8) + lane % 2;
    float z[4] = {0.f, 0.f, 0.f, 0.f};
    auto xv_mma = [&](const uint4& a0, const uint4& a1, uint4 vw) {
      if (v_rows) {  // uniform over the block
        *stage_row = vw;
        __syncwarp();
        vw = ldmatrix_x4_trans(stage_address);
        __syncwarp();  // every lane has its operands before the next chunk overwrites the tile
      }
      mma_16816<T>(z, a0.x, a1.x, a0.y, a1.y, vw.x, vw.y);
      mma_16816<T>(z, a0.z, a1.z, a0.w, a1.w, vw.z, vw.w);
    };
#pragma unroll
    for (int i = 0; i < kEarlyChunks; ++i) xv_mma(pa0[i], pa1[i], pv[i]);
#pragma unroll 4
    for (int q = kp + kEarlyChunks * kparts; q < nchunks; q += kparts) {
      const int k = k_begin + q * kChunk;
      const bool in = k + 8 * c < k_end;
      const uint4 a0 = in && x_ok0 ? ld_cached16(x0 + k) : zero4();
      const uint4 a1 = NT == 2 && in && x_ok1 ? ld_cached16(x1 + k) : zero4();
      xv_mma(a0, a1, load_v(q, true));
    }
    // z: tokens (g, g+8) x ranks (2c, 2c+1) of this tile.
    float* zp = zpart + warp * (kTokens * 8);
    zp[g * 8 + 2 * c] = z[0];
    zp[g * 8 + 2 * c + 1] = z[1];
    zp[(g + 8) * 8 + 2 * c] = z[2];
    zp[(g + 8) * 8 + 2 * c + 1] = z[3];
  }
  __syncthreads();
  for (int i = tid; i < kTokens * rp; i += kThreads) {
    const int m = i / rp, j = i % rp, jt = j / 8;
    float sum = 0.f;
    if (m < M && j < r) {
      for (int kp = 0; kp < kparts; ++kp) sum += zpart[(jt * kparts + kp) * (kTokens * 8) + m * 8 + j % 8];
      zb[m * r + j] = sum;
      sum *= p.scale * (codes ? to_acc(codes[m * r + j]) : 1.f);
    }
    zc[m * rp + j] = from_acc<T>(sum);
  }
  __syncthreads();

  // acc = U[rows] (s zb ⊙ c)^T, k = rank; then X W^T accumulates on top.
  // acc[t] holds rows (g, g+8) x tokens (8t + 2c, 8t + 2c + 1) of Y^T.
  float acc[NT][4] = {};
#pragma unroll
  for (int s = 0; s < kRankSteps; ++s) {
    if (16 * s >= rp) break;
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const T* zt = zc + (8 * t + g) * rp + 16 * s + 2 * c;  // even offset: one 4-byte word per pair
      mma_16816<T>(acc[t], ua[s][0], ua[s][1], ua[s][2], ua[s][3], *reinterpret_cast<const uint32_t*>(zt),
                   *reinterpret_cast<const uint32_t*>(zt + 8));
    }
  }

  // ---- X W^T over this block's slice of K ----
  uint4 xa, xb = zero4(), xa_next, xb_next = zero4();
  load_x(0, xa, xb);
  for (int q = 0; q < nchunks; ++q) {
    issue(q + kStages - 1);
    cp_async_commit();
    load_x(q + 1, xa_next, xb_next);  // the next chunk's x is in flight while this one computes
    cp_async_wait<kStages - 1>();     // this thread's copies of chunk q have landed
    const int slot = q % kStages;
    const uint4 wa = ring[(slot * 2) * kThreads + tid], wb = ring[(slot * 2 + 1) * kThreads + tid];
    mma_16816<T>(acc[0], wa.x, wb.x, wa.y, wb.y, xa.x, xa.y);
    mma_16816<T>(acc[0], wa.z, wb.z, wa.w, wb.w, xa.z, xa.w);
    if constexpr (NT == 2) {
      mma_16816<T>(acc[NT - 1], wa.x, wb.x, wa.y, wb.y, xb.x, xb.y);
      mma_16816<T>(acc[NT - 1], wa.z, wb.z, wa.w, wb.w, xb.z, xb.w);
    }
    xa = xa_next;
    xb = xb_next;
  }
  cp_async_wait<0>();
  __syncthreads();  // every thread is done with the ring: ys takes its bytes
#pragma unroll
  for (int t = 0; t < NT; ++t) {
    const int m = 8 * t + 2 * c, n = warp * 16 + g;
    ys[m * kYLd + n] = acc[t][0];
    ys[(m + 1) * kYLd + n] = acc[t][1];
    ys[m * kYLd + n + 8] = acc[t][2];
    ys[(m + 1) * kYLd + n + 8] = acc[t][3];
  }
  cluster.sync();  // every block's ys and zb are complete and visible to the cluster

  // ---- Sum the cluster's partial rows [rank * rows, (rank + 1) * rows) in a fixed order ----
  const int rows = kRows / cs, row_begin = rank * rows;
  for (int i = tid; i < rows * M; i += kThreads) {
    const int nl = row_begin + i % rows, m = i / rows, n = n0 + nl;
    if (n >= N) continue;
    float y = cluster_sum(cluster, ys, m * kYLd + nl, cs);
    if (bias) y += to_acc(bias[n]);
    Y[(size_t)m * N + n] = from_acc<T>(y);
  }
  if (p.P && blockIdx.x == 0 && rank == 0) {  // X V for the backward (skipped at inference)
    for (int i = tid; i < M * r; i += kThreads) p.P[i] = cluster_sum(cluster, zb, i, cs);
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

cudaLaunchConfig_t launch_config(const DecodeArgs& a, cudaLaunchAttribute* attribute, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.N + kRows - 1) / kRows, a.split_k, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.dynamicSmemBytes = kSmemBytes;
  config.stream = stream;
  attribute[0].id = cudaLaunchAttributeClusterDimension;
  attribute[0].val.clusterDim.x = 1;
  attribute[0].val.clusterDim.y = a.split_k;
  attribute[0].val.clusterDim.z = 1;
  config.attrs = attribute;
  config.numAttrs = 1;
  return config;
}

template <typename T, int NT>
cudaError_t launch_typed(const DecodeArgs& a, cudaStream_t stream) {
  cudaError_t err = raise_smem_limit<decode_stream_kernel<T, NT>>(kSmemBytes);
  if (err != cudaSuccess) return err;
  cudaLaunchAttribute attribute[1];
  const cudaLaunchConfig_t config = launch_config(a, attribute, stream);
  return cudaLaunchKernelEx(&config, decode_stream_kernel<T, NT>, a);
}

template <typename T>
cudaError_t launch_tokens(const DecodeArgs& a, cudaStream_t stream) {
  return a.M <= 8 ? launch_typed<T, 1>(a, stream) : launch_typed<T, 2>(a, stream);
}

// How many clusters of `cs` blocks the device runs at once: clusters live inside one GPC, so this is
// less than (blocks per multiprocessor x multiprocessors) / cs, and a grid with more clusters than
// this runs a second wave. Read once per device and cluster size.
int resident_clusters(int cs, int device) {
  static std::mutex lock;
  static std::map<std::pair<int, int>, int> cache;
  std::lock_guard<std::mutex> guard(lock);
  auto found = cache.find({device, cs});
  if (found != cache.end()) return found->second;
  int clusters = 0;
  if (raise_smem_limit<decode_stream_kernel<__nv_bfloat16, 2>>(kSmemBytes) == cudaSuccess) {
    DecodeArgs probe{};
    probe.N = kRows;
    probe.split_k = cs;
    cudaLaunchAttribute attribute[1];
    const cudaLaunchConfig_t config = launch_config(probe, attribute, nullptr);
    if (cudaOccupancyMaxActiveClusters(&clusters, decode_stream_kernel<__nv_bfloat16, 2>, &config) != cudaSuccess) {
      cudaGetLastError();  // not sticky: clear it, and plan as if nothing were resident
      clusters = 0;
    }
  }
  cache[{device, cs}] = clusters;
  return clusters;
}

}  // namespace

bool decode_stream_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && a.M >= 1 && a.M <= kDecodeStreamMaxTokens && !a.w_transposed && a.K % 8 == 0 &&
         a.r >= 1 && a.r <= kDecodeStreamMaxRank && aligned16(a.X) && aligned16(a.W);
}

int decode_stream_split(int N, int K, int device) {
  // The largest cluster (K split) whose grid runs in one wave, with at least 256 columns of K a block.
  const int tiles = (N + kRows - 1) / kRows;
  for (int cs = kDecodeStreamMaxCluster; cs > 1; cs /= 2)
    if (K / cs >= 256 && tiles <= resident_clusters(cs, device)) return cs;
  return 1;
}

cudaError_t launch_decode_stream(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.split_k < 1 || args.split_k > kDecodeStreamMaxCluster || kRows % args.split_k != 0 ||
      args.k_per_split % kChunk != 0 || (size_t)args.split_k * args.k_per_split < (size_t)args.K)
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_tokens<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
