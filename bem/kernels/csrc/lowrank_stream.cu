// The generated update s * ((A B) ⊙ codes) U^T at prefill sizes, streaming A once and Y once.
//
// A block owns 16 MT rows (tokens) and 8 NT ranks (r rounded up to 8, 16, 32 or 64). Phase 1: its 8
// warps split K into contiguous runs; each warp loads A (every token tile) and B^T (r x L, the
// transposed copy of B) with 16-byte loads straight into tensor-core registers (the k-map of
// common.cuh), so A streams in long contiguous runs with no shared-memory staging and no barrier, and
// each B^T load serves MT token tiles. The 8 partial products meet once in shared memory and are summed
// in a fixed order into s P ⊙ c, stored in A's dtype as plain PyTorch rounds it. Phase 2 computes
// Y^T tiles as U · (s P ⊙ c)^T: two 4-byte loads per 16 ranks of each of U's rows (the A operand) serve
// all the block's tokens, whose fragments stay in registers. Column tiles of 32 are interleaved across
// the warps (a block writes whole row runs) and go out through a per-warp staging buffer as 16-byte
// stores.
#include "common.cuh"
#include "launchers.h"

namespace bem {
namespace {

constexpr int kWarps = 8, kThreads = 256, kChunk = 32, kColTile = 32;
constexpr int kLoadsInFlight = 16;  // 16-byte loads of A per thread issued before their products

struct StreamFlags {
  bool expand, accumulate, y_vec;
};

template <int MT, int NT> struct StreamShape {
  static constexpr int tokens = 16 * MT, ranks = 8 * NT;
  static constexpr int batch = kLoadsInFlight / (2 * MT);  // K chunks loaded at once
  static constexpr int ksteps = (ranks + 15) / 16;         // phase 2's k16 steps over the ranks
  static constexpr int z_ld = ranks + 1;                   // fp32 partials: odd stride spreads the banks
  static constexpr int z_floats = kWarps * tokens * z_ld;
  static constexpr int y_ld = kColTile + 4;
  static constexpr int y_floats = kWarps * 16 * y_ld;     // per warp: 16 tokens x 32 columns
  static constexpr int pc_ld = ranks + 2;                  // s P ⊙ c in A's dtype, one row per token
  static constexpr size_t pc_offset = (size_t)cmax(z_floats, y_floats) * 4;
  static constexpr size_t smem_bytes = pc_offset + (size_t)tokens * pc_ld * 2;
};

template <typename T, int MT, int NT>
__global__ void __launch_bounds__(kThreads, 2) lowrank_stream_kernel(LowRankArgs a, StreamFlags f) {
  using S = StreamShape<MT, NT>;
  extern __shared__ __align__(16) unsigned char smem_raw[];
  float* zbuf = reinterpret_cast<float*>(smem_raw);  // phase 1's partials, then phase 2's staging
  T* pcs = reinterpret_cast<T*>(smem_raw + S::pc_offset);
  const T* A = static_cast<const T*>(a.A);
  const T* Bt = static_cast<const T*>(a.Bt);
  const T* codes = static_cast<const T*>(a.codes);
  const T* U = static_cast<const T*>(a.U);
  const T* bias = static_cast<const T*>(a.bias);
  T* Y = static_cast<T*>(a.Y);
  float* P = static_cast<float*>(a.P);
  const int M = a.M, L = a.L, N = a.N, r = a.r;
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32, g = lane / 4, c = lane % 4;
  const int m0 = blockIdx.x * S::tokens;

  // ---- Phase 1: this warp's share of K for every token of the block ----
  const int chunks = (L + kChunk - 1) / kChunk;
  const int per_warp = (chunks + kWarps - 1) / kWarps;
  const int q_begin = warp * per_warp, q_end = min(chunks, q_begin + per_warp);
  const T* a_base = A + (size_t)m0 * L + 8 * c;
  bool row_ok[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int h = 0; h < 2; ++h) row_ok[mt][h] = m0 + 16 * mt + 8 * h + g < M;
  const T* bt[NT];
  bool rank_ok[NT];
#pragma unroll
  for (int nt = 0; nt < NT; ++nt) {
    rank_ok[nt] = 8 * nt + g < r;
    bt[nt] = Bt + (size_t)(rank_ok[nt] ? 8 * nt + g : 0) * L + 8 * c;
  }
  float z[MT][NT][4] = {};
  for (int q = q_begin; q < q_end; q += S::batch) {
    uint4 xa[S::batch][MT][2];
#pragma unroll
    for (int i = 0; i < S::batch; ++i) {
      const int k = (q + i) * kChunk;
      const bool in = q + i < q_end && k + 8 * c < L;  // L % 8 == 0: a group of 8 is all in or out
#pragma unroll
      for (int mt = 0; mt < MT; ++mt)
#pragma unroll
        for (int h = 0; h < 2; ++h)
          xa[i][mt][h] = in && row_ok[mt][h] ? ld_stream16(a_base + (size_t)(16 * mt + 8 * h + g) * L + k) : zero4();
    }
#pragma unroll
    for (int i = 0; i < S::batch; ++i) {
      const int k = (q + i) * kChunk;
      const bool in = q + i < q_end && k + 8 * c < L;
#pragma unroll
      for (int nt = 0; nt < NT; ++nt) {
        const uint4 vb = in && rank_ok[nt] ? ld_cached16(bt[nt] + k) : zero4();
#pragma unroll
        for (int mt = 0; mt < MT; ++mt) {
          const uint4 x0 = xa[i][mt][0], x1 = xa[i][mt][1];
          mma_16816<T>(z[mt][nt], x0.x, x1.x, x0.y, x1.y, vb.x, vb.y);
          mma_16816<T>(z[mt][nt], x0.z, x1.z, x0.w, x1.w, vb.z, vb.w);
        }
      }
    }
  }
  // z[mt][nt]: tokens 16 mt + (g, g + 8) x ranks 8 nt + (2c, 2c + 1), this warp's share of K.
  float* zs = zbuf + warp * S::tokens * S::z_ld;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt)
#pragma unroll
    for (int nt = 0; nt < NT; ++nt) {
      const int t0 = 16 * mt + g, j = 8 * nt + 2 * c;
      zs[t0 * S::z_ld + j] = z[mt][nt][0];
      zs[t0 * S::z_ld + j + 1] = z[mt][nt][1];
      zs[(t0 + 8) * S::z_ld + j] = z[mt][nt][2];
      zs[(t0 + 8) * S::z_ld + j + 1] = z[mt][nt][3];
    }
  __syncthreads();

  // ---- P summed over the warps in a fixed order (coalesced P and codes); s P ⊙ c to shared memory ----
  for (int e = threadIdx.x; e < S::tokens * S::ranks; e += kThreads) {
    const int tok = e / S::ranks, j = e % S::ranks, gm = m0 + tok;
    float sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) sum += zbuf[(w * S::tokens + tok) * S::z_ld + j];
    const bool valid = gm < M && j < r;
    if (valid && P != nullptr) P[(size_t)gm * r + j] = sum;
    const float code = valid && codes ? to_acc(codes[(size_t)gm * r + j]) : 1.f;
    pcs[tok * S::pc_ld + j] = from_acc<T>(valid ? static_cast<float>(a.scale) * sum * code : 0.f);
  }
  if (!f.expand) return;
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
  const int tiles = (N + kColTile - 1) / kColTile;
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
  load_u(warp, ua);
  for (int t = warp; t < tiles; t += kWarps) {
    const int n0 = t * kColTile;
    load_u(t + kWarps, ua_next);  // the next tile's U is in flight while this one computes
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
          store8<T>(Y + (size_t)gm * N + gn, v, bias ? bias + gn : nullptr, f.accumulate);
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
  }
}

template <typename T, int MT, int NT>
cudaError_t launch_typed(const LowRankArgs& a, cudaStream_t stream) {
  static_assert(MT * NT <= 16, "the partial products would not fit in registers and shared memory");
  const cudaError_t err =
      raise_smem_limit<lowrank_stream_kernel<T, MT, NT>>((int)StreamShape<MT, NT>::smem_bytes);
  if (err != cudaSuccess) return err;
  StreamFlags f;
  f.expand = a.expand;
  f.accumulate = a.accumulate;
  f.y_vec = a.expand && a.N % 8 == 0 && aligned16(a.Y) && (a.bias == nullptr || aligned16(a.bias));
  const dim3 grid((a.M + 16 * MT - 1) / (16 * MT));
  lowrank_stream_kernel<T, MT, NT><<<grid, kThreads, StreamShape<MT, NT>::smem_bytes, stream>>>(a, f);
  return cudaGetLastError();
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
  // 16-byte loads of A and B^T rows (L % 8), 4-byte loads of U's rank pairs (r % 8 keeps them aligned).
  const bool tokens_ok = a.stream_tokens == 0 || a.stream_tokens == 16 || a.stream_tokens == 32 ||
                         (a.stream_tokens == 64 && a.r <= kStreamTallBlockMaxRank);
  return a.L % 8 == 0 && a.r % 8 == 0 && a.r >= 8 && a.r <= kStreamMaxRank && aligned16(a.A) &&
         (!a.expand || aligned16(a.U)) && a.P_in == nullptr && tokens_ok;
}

int lowrank_stream_tokens(const LowRankArgs& a) {
  if (a.stream_tokens != 0) return a.stream_tokens;
  // The most tokens per block (each B^T and U load serves them all) that still gives every
  // multiprocessor two blocks; 64 only up to rank 32 (registers).
  const int wanted_blocks = 2 * (a.num_sms > 0 ? a.num_sms : 1);
  for (int tokens : {64, 32}) {
    if (tokens == 64 && a.r > kStreamTallBlockMaxRank) continue;
    if ((a.M + tokens - 1) / tokens >= wanted_blocks) return tokens;
  }
  return 16;
}

cudaError_t launch_lowrank_stream(DType dtype, const LowRankArgs& args, cudaStream_t stream) {
  if (!lowrank_stream_fits(args) || args.Bt == nullptr || !aligned16(args.Bt)) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) { return launch_tokens<typename decltype(t)::type>(args, stream); });
}

}  // namespace bem
