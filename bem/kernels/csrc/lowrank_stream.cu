// The generated update s * ((A B) ⊙ codes) U^T at prefill sizes, streaming A once and Y once.
//
// A block owns 16 rows (tokens). Phase 1: its 8 warps split K into contiguous runs and load A and
// B^T (r x L, the transposed copy of B) with 16-byte loads straight into tensor-core registers (the
// k-map of common.cuh), kBatch chunks at a time, so A streams in long contiguous runs with no
// shared-memory staging and no barrier (a per-thread cp.async ring measured slower here). The 8
// partial products meet once in shared memory, in a fixed order. Phase 2 computes
// Y^T tiles as U · (s P ⊙ c)^T: U's rows are the A operand, again one 16-byte load per 8 ranks, and
// P's accumulator fragments are already the B operand's layout, so nothing moves between the phases
// but one reduction. Column tiles of 32 are interleaved across the warps (a block writes whole row
// runs) and go out through a small per-warp staging buffer as 16-byte stores.
//
// The rank map. Phase 2 loads U[n, 32q + 8c .. 8c + 7] into thread c of each quad; the mma reads
// those 8 values as the logical ranks 32q + 8h + 2c + e (h = 0..3, e = 0..1) at physical rank
// 32q + 8c + 2h + e. Phase 1 therefore loads, as logical rank j, the row phys(j) of B^T, and the
// codes and P are read and written at phys(j). Logical ranks whose physical rank is >= r are zeros.
#include "common.cuh"
#include "launchers.h"

namespace bem {
namespace {

constexpr int kWarps = 8, kThreads = 256, kTokens = 16, kChunk = 32, kColTile = 32;
constexpr int kBatch = 4;  // chunks of A loaded before they are used

struct StreamFlags {
  bool expand, accumulate, y_vec;
};

__device__ __forceinline__ int phys_rank(int logical) {
  const int q = logical / 32, h = (logical / 8) % 4, c = (logical / 2) % 4, e = logical % 2;
  return 32 * q + 8 * c + 2 * h + e;
}

template <int RQ> struct StreamSmem {  // RQ: groups of 32 ranks
  static constexpr int z_ld = RQ * 32 + 1;
  static constexpr int z_floats = kWarps * kTokens * z_ld;
  static constexpr int y_ld = kColTile + 4;
  static constexpr int y_floats = kWarps * kTokens * y_ld;
  static constexpr int floats = z_floats > y_floats ? z_floats : y_floats;
};

template <typename T, int RQ>
__global__ void __launch_bounds__(kThreads) lowrank_stream_kernel(LowRankArgs a, StreamFlags f) {
  using Smem = StreamSmem<RQ>;
  constexpr int JT = RQ * 4;  // logical rank tiles of 8 (phase 1's n8 tiles)
  constexpr int KS = RQ * 2;  // k16 steps over the ranks (phase 2)
  __shared__ float smem[Smem::floats];
  const T* A = static_cast<const T*>(a.A);
  const T* Bt = static_cast<const T*>(a.Bt);
  const T* codes = static_cast<const T*>(a.codes);
  const T* U = static_cast<const T*>(a.U);
  const T* bias = static_cast<const T*>(a.bias);
  T* Y = static_cast<T*>(a.Y);
  float* P = static_cast<float*>(a.P);
  const int M = a.M, L = a.L, N = a.N, r = a.r;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = blockIdx.x * kTokens;

  // ---- Phase 1: P over this warp's contiguous run of K ----
  const int chunks = (L + kChunk - 1) / kChunk;
  const int per_warp = (chunks + kWarps - 1) / kWarps;
  const int q_begin = warp * per_warp, q_end = min(chunks, q_begin + per_warp);
  const bool ok0 = m0 + g < M, ok1 = m0 + g + 8 < M;
  const T* a0 = A + (size_t)(ok0 ? m0 + g : 0) * L + 8 * c;
  const T* a1 = A + (size_t)(ok1 ? m0 + g + 8 : 0) * L + 8 * c;
  const T* bt[JT];
  bool jok[JT];
#pragma unroll
  for (int jt = 0; jt < JT; ++jt) {
    const int j = phys_rank(jt * 8 + g);
    jok[jt] = j < r;
    bt[jt] = Bt + (size_t)(jok[jt] ? j : 0) * L + 8 * c;
  }
  float z[JT][4] = {};
  for (int q = q_begin; q < q_end; q += kBatch) {
    uint4 xa[kBatch], xb[kBatch];
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int k = (q + i) * kChunk;
      const bool in = q + i < q_end && k + 8 * c < L;  // L % 8 == 0: a group of 8 is all in or out
      xa[i] = in && ok0 ? ld_stream16(a0 + k) : zero4();
      xb[i] = in && ok1 ? ld_stream16(a1 + k) : zero4();
    }
#pragma unroll
    for (int i = 0; i < kBatch; ++i) {
      const int k = (q + i) * kChunk;
      const bool in = q + i < q_end && k + 8 * c < L;
#pragma unroll
      for (int jt = 0; jt < JT; ++jt) {
        const uint4 vb = in && jok[jt] ? ld_cached16(bt[jt] + k) : zero4();
        mma_16816<T>(z[jt], xa[i].x, xb[i].x, xa[i].y, xb[i].y, vb.x, vb.y);
        mma_16816<T>(z[jt], xa[i].z, xb[i].z, xa[i].w, xb[i].w, vb.z, vb.w);
      }
    }
  }
  // z[jt]: tokens (g, g + 8) x logical ranks (8 jt + 2c, + 1), this warp's share of K.
  float* zs = smem + warp * kTokens * Smem::z_ld;
#pragma unroll
  for (int jt = 0; jt < JT; ++jt) {
    const int j = jt * 8 + 2 * c;
    zs[g * Smem::z_ld + j] = z[jt][0];
    zs[g * Smem::z_ld + j + 1] = z[jt][1];
    zs[(g + 8) * Smem::z_ld + j] = z[jt][2];
    zs[(g + 8) * Smem::z_ld + j + 1] = z[jt][3];
  }
  __syncthreads();

  // ---- P summed over the warps in a fixed order; s * P ⊙ c as phase 2's B fragments ----
  // pc[s][t]: k16 step s, token tile t (tokens g + 8t): logical ranks 16s + 2c + {0,1} and + 8.
  uint32_t pc[KS][2][2];
#pragma unroll
  for (int st = 0; st < KS; ++st)
#pragma unroll
    for (int t = 0; t < 2; ++t)
#pragma unroll
      for (int hi = 0; hi < 2; ++hi) {
        const int tok = g + 8 * t, gm = m0 + tok, lj = st * 16 + 8 * hi + 2 * c;
        float v[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int j = phys_rank(lj + e);
          const bool valid = gm < M && j < r;
          float sum = 0.f;
#pragma unroll
          for (int w = 0; w < kWarps; ++w) sum += smem[(w * kTokens + tok) * Smem::z_ld + lj + e];
          if (valid && P != nullptr && warp == 0) P[(size_t)gm * r + j] = sum;
          const float code = valid && codes ? to_acc(codes[(size_t)gm * r + j]) : 1.f;
          v[e] = valid ? a.scale * sum * code : 0.f;
        }
        pc[st][t][hi] = pack2(from_acc<T>(v[0]), from_acc<T>(v[1]));
      }
  if (!f.expand) return;
  __syncthreads();  // the staging buffers below reuse the partial products' memory

  // ---- Phase 2: Y^T[32-column tile, 16 tokens] = U[tile] · pc, tiles interleaved across the warps ----
  float* ys = smem + warp * kTokens * Smem::y_ld;
  const int tiles = (N + kColTile - 1) / kColTile;
  auto load_u = [&](int t, uint4 (&ua)[2][2][RQ]) {  // [row tile][row g | g + 8][rank group]
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int n = t * kColTile + rt * 16 + g + 8 * h;
#pragma unroll
        for (int rq = 0; rq < RQ; ++rq)
          ua[rt][h][rq] = t < tiles && n < N && rq * 32 + 8 * c < r
                              ? ld_cached16(U + (size_t)n * r + rq * 32 + 8 * c) : zero4();
      }
  };
  uint4 ua[2][2][RQ], ua_next[2][2][RQ];
  load_u(warp, ua);
  for (int t = warp; t < tiles; t += kWarps) {
    const int n0 = t * kColTile;
    load_u(t + kWarps, ua_next);  // the next tile's U is in flight while this one computes
#pragma unroll
    for (int rt = 0; rt < 2; ++rt) {
      float d[2][4] = {};
#pragma unroll
      for (int rq = 0; rq < RQ; ++rq) {
        const uint4 u0 = ua[rt][0][rq], u1 = ua[rt][1][rq];
#pragma unroll
        for (int tt = 0; tt < 2; ++tt) {
          mma_16816<T>(d[tt], u0.x, u1.x, u0.y, u1.y, pc[2 * rq][tt][0], pc[2 * rq][tt][1]);
          mma_16816<T>(d[tt], u0.z, u1.z, u0.w, u1.w, pc[2 * rq + 1][tt][0], pc[2 * rq + 1][tt][1]);
        }
      }
      // d[tt]: columns (rt * 16 + g, + 8) x tokens (8 tt + 2c, + 1)
#pragma unroll
      for (int tt = 0; tt < 2; ++tt) {
        const int col = rt * 16 + g, tok = 8 * tt + 2 * c;
        ys[tok * Smem::y_ld + col] = d[tt][0];
        ys[(tok + 1) * Smem::y_ld + col] = d[tt][1];
        ys[tok * Smem::y_ld + col + 8] = d[tt][2];
        ys[(tok + 1) * Smem::y_ld + col + 8] = d[tt][3];
      }
    }
    __syncwarp();
    if (f.y_vec) {
      // 16 rows x 4 groups of 8 columns: lane l writes rows l / 4 and l / 4 + 8, columns 8 (l % 4).
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const int row = lane / 4 + 8 * h, col = (lane % 4) * 8, gm = m0 + row, gn = n0 + col;
        if (gm >= M || gn >= N) continue;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = ys[row * Smem::y_ld + col + e];
        store8<T>(Y + (size_t)gm * N + gn, v, bias ? bias + gn : nullptr, f.accumulate);
      }
    } else {
      for (int i = lane; i < kTokens * kColTile; i += 32) {
        const int row = i / kColTile, col = i % kColTile, gm = m0 + row, gn = n0 + col;
        if (gm >= M || gn >= N) continue;
        float v = ys[row * Smem::y_ld + col];
        if (bias) v += to_acc(bias[gn]);
        T* dst = Y + (size_t)gm * N + gn;
        if (f.accumulate) v += to_acc(*dst);
        *dst = from_acc<T>(v);
      }
    }
    __syncwarp();  // the staging buffer is rewritten by the next tile
#pragma unroll
    for (int rt = 0; rt < 2; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h)
#pragma unroll
        for (int rq = 0; rq < RQ; ++rq) ua[rt][h][rq] = ua_next[rt][h][rq];
  }
}


template <typename T, int RQ>
cudaError_t launch_typed(const LowRankArgs& a, cudaStream_t stream) {
  StreamFlags f;
  f.expand = a.expand;
  f.accumulate = a.accumulate;
  f.y_vec = a.expand && a.N % 8 == 0 && aligned16(a.Y) && (a.bias == nullptr || aligned16(a.bias));
  const dim3 grid((a.M + kTokens - 1) / kTokens);
  lowrank_stream_kernel<T, RQ><<<grid, kThreads, 0, stream>>>(a, f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_rank(const LowRankArgs& a, cudaStream_t stream) {
  if (a.r <= 32) return launch_typed<T, 1>(a, stream);
  if (a.r <= kStreamMaxRank) return launch_typed<T, 2>(a, stream);
  return cudaErrorInvalidValue;
}

}  // namespace

bool lowrank_stream_fits(const LowRankArgs& a) {
  // 16-byte loads of A and B^T rows (L % 8) and of U rows (r % 8).
  return a.L % 8 == 0 && a.r % 8 == 0 && a.r >= 8 && a.r <= kStreamMaxRank && aligned16(a.A) &&
         (!a.expand || aligned16(a.U)) && a.P_in == nullptr;
}

cudaError_t launch_lowrank_stream(DType dtype, const LowRankArgs& args, cudaStream_t stream) {
  if (!lowrank_stream_fits(args) || args.Bt == nullptr || !aligned16(args.Bt)) return cudaErrorInvalidValue;
  switch (dtype) {
    case DType::kHalf: return launch_rank<__half>(args, stream);
    case DType::kBFloat16: return launch_rank<__nv_bfloat16>(args, stream);
    default: return cudaErrorInvalidValue;
  }
}

}  // namespace bem
