// The BEM linear at decode sizes (M <= 16 tokens, Hopper), reading W once:
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// Decode is a read of W and nothing else, so the kernel is built around that read: every thread keeps
// its own ring of 16-byte cp.async copies of W in flight (kStages chunks deep) and reads back only
// what it copied, so no barrier ever stalls the stream; each copy is already in the layout of a
// tensor-core operand (see the k-map note in common.cuh), and rows are read in long contiguous runs.
// A block owns 128 rows of W over one slice of K; the CS blocks that share those rows form a
// thread-block cluster. After the stream and one cluster barrier, block q of the cluster sums the CS
// partial results for its 128/CS rows through distributed shared memory in a fixed order
// (deterministic, no workspace, no counters), adds b and writes Y.
//
// The update needs P = X V, a sum over all of K, for every row tile. Two ways, chosen by measurement:
// - in the block (ranks up to 16, slices up to kOwnProjectionMaxK): since the update is linear in X V,
//   each block adds its own share s ((X V)_slice ⊙ c) U^T, computed before its stream (the first loads
//   of its X V requested before any of W, so they do not queue behind the whole grid's copies). Every
//   row tile reads all of V again, which costs r / 128 of W's bytes in L2 reads, and the X V phase
//   delays the stream by its latency, which grows with the slice;
// - in a projection launch before the stream (decode_project_kernel): one cluster reads X and V once and
//   writes Pc = s (X V) ⊙ c; it lets the stream start at once (programmatic dependent launch), and the
//   first block of each stream cluster loads Pc half-way through its stream and adds Pc U^T to its
//   rows. That launch costs about 1.5-2 µs of the stream's time wherever the rank is.

#include "decode_projection.cuh"

namespace bem {
namespace {

constexpr int kRows = 128;    // rows of W per block: 16 per warp
// Chunks of W in flight per thread (2 x 16 bytes each). Five, not more: the ring's shared memory is
// taken from L1, and the stream's loop reads x from L1 (16 tokens: 16 KB a block). On an H200, 8, 7,
// 6 and 5 stages gave M = 16, 4096², r = 8: 1.30, 1.26, 1.24, 1.20x F.linear; M = 1: 1.14 -> 1.10x.
constexpr int kStages = 5;
constexpr int kYLd = kRows + 4;
// Dynamic shared memory: the ring, then (in-block projection only) the X V buffers, live until the
// stream starts; the partial X W^T (ys, read by the cluster at the end) reuses the ring's bytes.
constexpr int kRingBytes = kStages * 2 * kThreads * 16;
constexpr int kOwnMaxRank = 16;
constexpr int kZpartOffset = kRingBytes;                                  // float [8 warps][16][8]
constexpr int kZbOffset = kZpartOffset + kWarps * kPartFloats * 4;        // float [16][16]
constexpr int kZcOffset = kZbOffset + kTokens * kOwnMaxRank * 4;          // T [2][16][16]: high and low parts
constexpr int kOwnSmemBytes = kZcOffset + 2 * kTokens * kOwnMaxRank * 2;
static_assert(kTokens * kYLd * 4 <= kRingBytes, "ys must fit in the ring's bytes");

// The in-block projection: ranks up to kOwnMaxRank and slices of K up to this. Measured on an H200
// (x F.linear, in-block / projection launch): 4096², slices of 512, M = 1 r = 8 1.09 / 1.17, r = 16
// 1.17 / 1.17, M = 16 r = 8 1.20 / 1.26; 2048² M = 1 r = 8 1.17 / 1.40; 14336 x 4096 (slices of
// 1792) M = 1 r = 8 1.34 / 1.17; 4096 x 14336 (2048) M = 1 r = 8 1.18 / 1.14; r = 32 at 4096², M = 1:
// 1.38 / 1.20.
constexpr int kOwnProjectionMaxK = 1024;
constexpr int kEarlyChunks = 2;  // chunks of a warp's in-block X V whose operands are requested before W

// OWN: the in-block projection (RS == 1); otherwise Pc comes from decode_project_kernel. RS: the
// update's k16 steps (1, 2 or 4: ranks up to 16, 32 or 64), so that the update's operands take no
// more registers than the rank needs.
template <typename T, int NT, int RS, bool OWN>
__global__ void __launch_bounds__(kThreads, 3) decode_stream_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  static_assert(!OWN || RS * 16 <= kOwnMaxRank, "the in-block projection's buffers hold 16 ranks");
  extern __shared__ __align__(16) unsigned char smem[];
  uint4* ring = reinterpret_cast<uint4*>(smem);  // [stage][row g | g + 8][thread]
  float* ys = reinterpret_cast<float*>(smem);    // after the stream: partial X W^T + update
  cg::cluster_group cluster = cg::this_cluster();
  const int cs = (int)cluster.num_blocks();
  const int rank = (int)cluster.block_rank();

  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* U = static_cast<const T*>(p.U);
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
  const T* u0 = U + (size_t)(w_ok0 ? row0 : 0) * r;
  const T* u1 = U + (size_t)(w_ok1 ? row0 + 8 : 0) * r;

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
  // The update's A operand: U's fragments for this thread's rows (g, g + 8), ranks 16s + 2c, + 1 and
  // 16s + 2c + 8, + 9: {row g lo, row g+8 lo, row g hi, row g+8 hi}.
  uint32_t ua[RS][4];
  auto load_u = [&]() {
#pragma unroll
    for (int s = 0; s < RS; ++s) {
      const int jj = 16 * s + 2 * c;
      ua[s][0] = u_pair(u0, w_ok0, jj, r);
      ua[s][1] = u_pair(u1, w_ok1, jj, r);
      ua[s][2] = u_pair(u0, w_ok0, jj + 8, r);
      ua[s][3] = u_pair(u1, w_ok1, jj + 8, r);
    }
  };

  // acc[t] holds rows (g, g+8) x tokens (8t + 2c, 8t + 2c + 1) of Y^T: the update, then X W^T on top.
  float acc[NT][4] = {};
  uint4 xa, xb = zero4();
  auto stream = [&](int q_from, int q_to) {  // X W^T over chunks [q_from, q_to) of the slice
#pragma unroll 2
    for (int q = q_from; q < q_to; ++q) {
      issue(q + kStages - 1);
      cp_async_commit();
      uint4 xa_next, xb_next = zero4();
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
  };
  auto start_ring = [&]() {  // the first kStages - 1 chunks of this thread's ring
#pragma unroll
    for (int q = 0; q < kStages - 1; ++q) {
      issue(q);
      cp_async_commit();
    }
  };

  if constexpr (OWN) {
    // ---- The update's share first: s ((X V)_slice ⊙ c) U^T over this block's slice ----
    float* zpart = reinterpret_cast<float*>(smem + kZpartOffset);
    float* zb = reinterpret_cast<float*>(smem + kZbOffset);  // this block's partial X V (M x 16)
    // s zb ⊙ c as mma operands, 0-padded, in two parts (zc + zl = the float32 value to 16 bits of mantissa):
    // each block's coefficient is a partial sum over its slice, which rounded to T alone added one rounding a
    // slice to the update (H100, 300 draws of the codes: median error 0.49-0.59x PyTorch's, now 0.42x).
    T* zc = reinterpret_cast<T*>(smem + kZcOffset);
    T* zl = zc + kTokens * kOwnMaxRank;
    // The staging tile is this warp's slice of zpart (512 bytes), free until the warp's results go there.
    const SliceProjection<T, NT> proj(p, k_begin, k_end, smem + kZpartOffset + warp * kPartFloats * 4);
    uint4 pa0[kEarlyChunks], pa1[kEarlyChunks], pv[kEarlyChunks];
#pragma unroll
    for (int i = 0; i < kEarlyChunks; ++i) proj.load(proj.kp + i * proj.kparts, pa0[i], pa1[i], pv[i]);
    start_ring();
    load_u();  // now, so its latency overlaps X V's
    if (proj.live) {
      float z[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int i = 0; i < kEarlyChunks; ++i) proj.mma(z, pa0[i], pa1[i], pv[i]);
#pragma unroll 4
      for (int q = proj.kp + kEarlyChunks * proj.kparts; q < proj.nchunks; q += proj.kparts) {
        uint4 a0, a1, v;
        proj.load(q, a0, a1, v);
        proj.mma(z, a0, a1, v);
      }
      proj.store(zpart + warp * kPartFloats, z);
    }
    __syncthreads();
    for (int i = tid; i < kTokens * rp; i += kThreads) {
      const int m = i / rp, jj = i % rp;
      float sum = 0.f;
      if (m < M && jj < r) {
        sum = proj.block_sum(zpart, m, jj);
        zb[m * kOwnMaxRank + jj] = sum;
        sum *= p.scale * (p.codes ? to_acc(static_cast<const T*>(p.codes)[m * r + jj]) : 1.f);
      }
      const T high = from_acc<T>(sum);
      zc[m * rp + jj] = high;
      zl[m * rp + jj] = from_acc<T>(sum - to_acc(high));
    }
    __syncthreads();
#pragma unroll
    for (int t = 0; t < NT; ++t) {
      const int at = (8 * t + g) * rp + 2 * c;  // even offset: one 4-byte word per pair
      mma_16816<T>(acc[t], ua[0][0], ua[0][1], ua[0][2], ua[0][3], *reinterpret_cast<const uint32_t*>(zl + at),
                   *reinterpret_cast<const uint32_t*>(zl + at + 8));
      mma_16816<T>(acc[t], ua[0][0], ua[0][1], ua[0][2], ua[0][3], *reinterpret_cast<const uint32_t*>(zc + at),
                   *reinterpret_cast<const uint32_t*>(zc + at + 8));
    }
    load_x(0, xa, xb);
    stream(0, nchunks);
  } else {
    start_ring();
    load_x(0, xa, xb);
    // Two halves: between them the first block of the cluster requests the update's operands, U's
    // fragments and Pc's (tokens as the mma's n8 columns, rank as k), which arrive while the second
    // half streams. Pc was written by the projection, which has finished by then, so the wait returns
    // at once. (Loaded inside one loop, behind a branch, they kept the compiler from unrolling it: the
    // next chunk's x was then requested only after the ring's wait, M = 16, 4096 x 14336: 1.77x.)
    const bool adds_update = rank == 0;
    const int half = nchunks / 2;
    stream(0, half);
    uint32_t pcw[NT][RS][2];
    if (adds_update) {
      wait_for_prerequisite();
      load_u();
      const T* Pc = static_cast<const T*>(p.Pc);
#pragma unroll
      for (int s = 0; s < RS; ++s)
#pragma unroll
        for (int t = 0; t < NT; ++t) {
          const bool ok = 8 * t + g < M;
          const uint32_t* pc = reinterpret_cast<const uint32_t*>(Pc + (size_t)(ok ? (8 * t + g) * rp + 16 * s + 2 * c : 0));
          pcw[t][s][0] = ok ? __ldcg(pc) : 0u;      // ranks 16s + 2c, + 1
          pcw[t][s][1] = ok ? __ldcg(pc + 4) : 0u;  // ranks 16s + 2c + 8, + 9
        }
    }
    stream(half, nchunks);
    if (adds_update) {  // acc += U[rows] Pc^T, k = rank
#pragma unroll
      for (int s = 0; s < RS; ++s)
#pragma unroll
        for (int t = 0; t < NT; ++t)
          mma_16816<T>(acc[t], ua[s][0], ua[s][1], ua[s][2], ua[s][3], pcw[t][s][0], pcw[t][s][1]);
    }
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
  cluster.sync();  // every block's ys (and zb) is complete and visible to the cluster

  // ---- Sum the cluster's partial rows [rank * rows, (rank + 1) * rows) in a fixed order ----
  const int rows = kRows / cs, row_begin = rank * rows;
  for (int i = tid; i < rows * M; i += kThreads) {
    const int nl = row_begin + i % rows, m = i / rows, n = n0 + nl;
    if (n >= N) continue;
    float y = cluster_sum<kDecodeStreamMaxCluster>(cluster, ys, m * kYLd + nl, cs);
    if (bias) y += to_acc(bias[n]);
    Y[(size_t)m * N + n] = from_acc<T>(y);
  }
  if constexpr (OWN) {
    if (p.P && blockIdx.x == 0 && rank == 0) {  // X V for the backward (skipped at inference)
      float* zb = reinterpret_cast<float*>(smem + kZbOffset);
      for (int i = tid; i < M * r; i += kThreads)
        p.P[i] = cluster_sum<kDecodeStreamMaxCluster>(cluster, zb, (i / r) * kOwnMaxRank + i % r, cs);
    }
  }
  cluster.sync();  // no block leaves while another still reads its shared memory
#endif
}

template <typename T, int NT, int RS, bool OWN>
cudaError_t launch_stream(const DecodeArgs& a, cudaStream_t stream) {
  const int smem_bytes = OWN ? kOwnSmemBytes : kRingBytes;
  cudaError_t err = raise_smem_limit<decode_stream_kernel<T, NT, RS, OWN>>(smem_bytes);
  if (err != cudaSuccess) return err;
  if (!OWN) {
    const int blocks = project_blocks(a.K);
    cudaLaunchAttribute project_cluster;
    const cudaLaunchConfig_t project =
        cluster_launch_config(dim3(blocks, 1, 1), kThreads, 0, stream, blocks, project_cluster);
    err = cudaLaunchKernelEx(&project, decode_project_kernel<T, NT>, a);
    if (err != cudaSuccess) return err;
  }
  cudaLaunchAttribute attribute[2];
  const cudaLaunchConfig_t config =
      split_k_config(a, kRows, kThreads, attribute, stream, smem_bytes, /*after_projection=*/!OWN);
  return cudaLaunchKernelEx(&config, decode_stream_kernel<T, NT, RS, OWN>, a);
}

template <typename T, int NT>
cudaError_t launch_ranks(const DecodeArgs& a, cudaStream_t stream) {
  if (!decode_stream_projects_first(a)) return launch_stream<T, NT, 1, true>(a, stream);
  return a.r <= 16 ? launch_stream<T, NT, 1, false>(a, stream)
         : a.r <= 32 ? launch_stream<T, NT, 2, false>(a, stream)
                     : launch_stream<T, NT, 4, false>(a, stream);
}

template <typename T>
cudaError_t launch_tokens(const DecodeArgs& a, cudaStream_t stream) {
  return a.M <= 8 ? launch_ranks<T, 1>(a, stream) : launch_ranks<T, 2>(a, stream);
}

// Clusters of `cs` blocks resident at once (common.cuh), for the in-block form, whose shared memory is the
// larger.
int resident_clusters(int cs, int device) {
  return split_k_resident_clusters<decode_stream_kernel<__nv_bfloat16, 2, 1, true>>(cs, device, kRows, kThreads,
                                                                                     kOwnSmemBytes);
}

}  // namespace

bool decode_stream_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && a.M >= 1 && a.M <= kDecodeStreamMaxTokens && !a.w_transposed && a.K % 8 == 0 &&
         a.r >= 1 && a.r <= kDecodeStreamMaxRank && aligned16(a.X) && aligned16(a.W);
}

int decode_stream_split(int N, int K, int device) {
  // The largest cluster (K split) whose grid runs in one wave, with at least 64 columns of K a block.
  // Small matrices are bound by the stream's latency, not its bytes, so more blocks win even on short
  // slices. H100, x F.linear at K split 2 / 4 / 8 (M = 1): 576 x 576 1.70 / 1.53 / 1.46; 1536 -> 576
  // 1.66 / 1.29 / 1.17 (a floor of 256 columns a block had kept these at 2 and 4).
  const int tiles = (N + kRows - 1) / kRows;
  return largest_one_wave_cluster(K, 64, tiles, kDecodeStreamMaxCluster,
                                  [device](int cs) { return resident_clusters(cs, device); });
}

bool decode_stream_projects_first(const DecodeArgs& a) {
  return !(a.r <= kOwnMaxRank && a.k_per_split <= kOwnProjectionMaxK);
}

cudaError_t launch_decode_stream(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.split_k < 1 || args.split_k > kDecodeStreamMaxCluster || kRows % args.split_k != 0 ||
      args.k_per_split % kChunk != 0 || (size_t)args.split_k * args.k_per_split < (size_t)args.K ||
      (decode_stream_projects_first(args) && args.Pc == nullptr))
    return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_tokens<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
