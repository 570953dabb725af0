// The backward's low-rank pieces at decode sizes (M <= kDecodeMaxTokens):
//
//     G = dY U,   dU = s dY^T (P ⊙ c),   dV = s X^T (G ⊙ c),   dcodes = s G ⊙ P,   C = s (G ⊙ c) V^T
//
// where C is the update's share of dX (the caller adds dY W). Two launches, every product on the tensor
// cores (wmma 16 x 16 x 16, fp32 accumulators); neither needs dY W, so both can run beside cuBLAS on
// another stream. The first walks dY's columns in chunks of 128 (rows of U): dU's rows, and G's partial
// sum over the block's chunks (at most kMaxPartials blocks). The second sums the partials in a fixed
// order (the result does not depend on timing), then takes 128 columns of X per block: dV's rows and
// C's columns; one more block writes dcodes. Nothing else waits across blocks. The coefficients
// s (P|G) ⊙ c are rounded to the operands' dtype, as the composed PyTorch backward does; G and dcodes
// stay fp32 until written. Before these two, the composed backward was about twenty small launches.
#include "../common/common.cuh"
#include "launchers.h"

namespace bem {
namespace {

using namespace nvcuda;

constexpr int kRows = 128;  // rows of dU or dV per chunk: 16 per warp
constexpr int kWarps = 8;
constexpr int kThreads = 32 * kWarps;
constexpr int kMaxPartials = 32;  // blocks of the first launch, i.e. G's partial sums
constexpr int kMaxGTiles = 4;     // G's 16 x 16 tiles per warp: (64 / 16) x (128 / 16) / kWarps
static_assert(kRows == 16 * kWarps, "one 16-row tile per warp");
static_assert((kDecodeMaxTokens / 16) * (kMaxFusedRank / 16) <= kMaxGTiles * kWarps, "G's tiles fit the warps");

int lowrank_grads_partials_of(int N) {
  const int chunks = (N + kRows - 1) / kRows;
  return chunks < 1 ? 1 : (chunks < kMaxPartials ? chunks : kMaxPartials);
}

struct GradFlags {
  int u_blocks, u_chunks, v_blocks;
  bool vec_x, vec_dy;  // 16-byte loads along X's and dY's rows
  bool vec_u, vec_v;   // 16-byte loads of U's and V's rows
  bool vec_out;        // 16-byte stores of dU's and dV's rows
};

// Shared-memory plan of both launches (MP = M and RQ = r rounded up to 16; rows padded by kPad).
struct Plan {
  int MP, RQ, ld_s, ld_w, ld_c;
  int slice_bytes, rows_bytes, coef_bytes;
  __host__ __device__ Plan(int M, int r)
      : MP(round_up(M, 16)), RQ(round_up(r, 16)), ld_s(kRows + kPad), ld_w(round_up(r, 16) + kPad),
        ld_c(round_up(r, 16) + kPad), slice_bytes(round_up(MP * ld_s * 2, 128)),
        rows_bytes(round_up(kRows * ld_w * 2, 128)), coef_bytes(round_up(MP * ld_c * 2, 128)) {}
  static constexpr int stage_ld = 16 + 4;
  static constexpr int stage_bytes = kWarps * 16 * stage_ld * 4;
  __host__ __device__ int bytes() const { return slice_bytes + rows_bytes + coef_bytes + stage_bytes; }
};

// slice[m][c] = A[m][row0 + c] (A: M x rows, row-major) for m < MP, c < kRows; zeros outside. The
// 16-byte path is asynchronous (cp.async; the caller waits), so its round trip overlaps other work.
template <typename T>
__device__ void stage_slice(T* slice, int ld, const T* A, int M, int MP, int rows, int row0, bool vec) {
  if (vec) {  // rows % 8 == 0: a group of 8 is wholly inside or wholly past the end
    for (int i = threadIdx.x; i < MP * kRows / 8; i += kThreads) {
      const int m = i / (kRows / 8), c = (i % (kRows / 8)) * 8;
      const bool ok = m < M && row0 + c < rows;
      cp_async16(slice + m * ld + c, ok ? A + (size_t)m * rows + row0 + c : A, ok);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < MP * kRows; i += kThreads) {
      const int m = i / kRows, c = i % kRows;
      slice[m * ld + c] = m < M && row0 + c < rows ? A[(size_t)m * rows + row0 + c] : from_acc<T>(0.f);
    }
  }
}

// rows_s[t][j] = B[row0 + t][j] (B: rows x r, row-major) for t < kRows, j < RQ; zeros outside.
template <typename T>
__device__ void stage_rows(T* rows_s, int ld, const T* B, int rows, int r, int RQ, int row0, bool vec) {
  if (vec) {  // r % 8 == 0
    for (int i = threadIdx.x; i < kRows * RQ / 8; i += kThreads) {
      const int t = i / (RQ / 8), j = (i % (RQ / 8)) * 8;
      const bool ok = row0 + t < rows && j < r;
      cp_async16(rows_s + t * ld + j, ok ? B + (size_t)(row0 + t) * r + j : B, ok);
    }
  } else {
#pragma unroll 4
    for (int i = threadIdx.x; i < kRows * RQ; i += kThreads) {
      const int t = i / RQ, j = i % RQ;
      rows_s[t * ld + j] = row0 + t < rows && j < r ? B[(size_t)(row0 + t) * r + j] : from_acc<T>(0.f);
    }
  }
}

// out[row0 + 16 w + i][:] = (slice^T coef)[16 w + i][:] for the warp's 16 rows (dU or dV).
template <typename T>
__device__ void write_grad_rows(T* out, const T* slice, const T* coef, float* stage, const Plan& pl, int rows, int r,
                                int row0, bool vec_out) {
  const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const int n0 = 16 * warp;
  for (int jt = 0; jt < pl.RQ / 16; ++jt) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int mt = 0; mt < pl.MP / 16; ++mt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::col_major> a;  // slice^T: (row, token)
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
      wmma::load_matrix_sync(a, slice + mt * 16 * pl.ld_s + n0, pl.ld_s);
      wmma::load_matrix_sync(b, coef + mt * 16 * pl.ld_c + jt * 16, pl.ld_c);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(stage, acc, Plan::stage_ld, wmma::mem_row_major);
    __syncwarp();
    const int i = lane / 2, c0 = (lane % 2) * 8, row = row0 + n0 + i, j0 = jt * 16 + c0;
    if (row < rows && j0 < r) {
      float v[8];
#pragma unroll
      for (int q = 0; q < 8; ++q) v[q] = stage[i * Plan::stage_ld + c0 + q];
      T* o = out + (size_t)row * r + j0;
      if (vec_out) {  // r % 8 == 0: all 8 columns are inside
        *reinterpret_cast<uint4*>(o) = pack8<T>(v);
      } else {
#pragma unroll
        for (int q = 0; q < 8; ++q)
          if (j0 + q < r) o[q] = from_acc<T>(v[q]);
      }
    }
    __syncwarp();
  }
}

template <typename T>
struct Smem {
  T* slice;  // MP x kRows of dY or X
  T* rows;   // kRows x RQ of U or V
  T* coef;   // MP x RQ: s (P|G) ⊙ c in T, zero padded
  float* stage;  // the warp's 16 x 16 accumulator tile
  __device__ Smem(unsigned char* base, const Plan& pl)
      : slice(reinterpret_cast<T*>(base)),
        rows(reinterpret_cast<T*>(base + pl.slice_bytes)),
        coef(reinterpret_cast<T*>(base + pl.slice_bytes + pl.rows_bytes)),
        stage(reinterpret_cast<float*>(base + pl.slice_bytes + pl.rows_bytes + pl.coef_bytes) +
              (threadIdx.x / 32) * 16 * Plan::stage_ld) {}
};

// First launch: dU, and this block's partial sum of G (MP x RQ fp32) into ws.
template <typename T>
__global__ void __launch_bounds__(kThreads) grads_u_kernel(LowRankGradArgs p, GradFlags f) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Plan pl(p.M, p.r);
  const Smem<T> s(smem, pl);
  const int M = p.M, r = p.r, warp = threadIdx.x / 32;
  const T* codes = static_cast<const T*>(p.codes);

  const int g_tiles = (pl.MP / 16) * (pl.RQ / 16);
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> g[kMaxGTiles];
#pragma unroll
  for (int i = 0; i < kMaxGTiles; ++i) wmma::fill_fragment(g[i], 0.f);

  for (int chunk = blockIdx.x; chunk < f.u_chunks; chunk += gridDim.x) {
    const int row0 = chunk * kRows;
    if (chunk != (int)blockIdx.x) __syncthreads();  // the previous chunk's slices are consumed
    stage_slice(s.slice, pl.ld_s, static_cast<const T*>(p.dY), M, pl.MP, p.N, row0, f.vec_dy);
    stage_rows(s.rows, pl.ld_w, static_cast<const T*>(p.U), p.N, r, pl.RQ, row0, f.vec_u);
    cp_async_commit();
    if (chunk == (int)blockIdx.x) {  // the coefficients while the first chunk's copies are in flight
#pragma unroll 4
      for (int i = threadIdx.x; i < pl.MP * pl.RQ; i += kThreads) {
        const int m = i / pl.RQ, j = i % pl.RQ;
        const bool valid = m < M && j < r;
        const float c = valid && codes ? to_acc(codes[(size_t)m * r + j]) : 1.f;
        s.coef[m * pl.ld_c + j] = from_acc<T>(valid ? p.scale * p.P[(size_t)m * r + j] * c : 0.f);
      }
    }
    cp_async_wait<0>();
    __syncthreads();
    write_grad_rows(static_cast<T*>(p.dU), s.slice, s.coef, s.stage, pl, p.N, r, row0, f.vec_out);
#pragma unroll
    for (int i = 0; i < kMaxGTiles; ++i) {  // G tile (mt, jt) += slice[mt] · U rows[:, jt]
      const int tile = warp + i * kWarps;
      if (tile >= g_tiles) break;
      const int mt = tile / (pl.RQ / 16), jt = tile % (pl.RQ / 16);
      for (int kt = 0; kt < kRows / 16; ++kt) {
        wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(a, s.slice + mt * 16 * pl.ld_s + kt * 16, pl.ld_s);
        wmma::load_matrix_sync(b, s.rows + kt * 16 * pl.ld_w + jt * 16, pl.ld_w);
        wmma::mma_sync(g[i], a, b, g[i]);
      }
    }
  }
  float* ws = p.ws + (size_t)blockIdx.x * pl.MP * pl.RQ;
#pragma unroll
  for (int i = 0; i < kMaxGTiles; ++i) {
    const int tile = warp + i * kWarps;
    if (tile >= g_tiles) break;
    const int mt = tile / (pl.RQ / 16), jt = tile % (pl.RQ / 16);
    wmma::store_matrix_sync(ws + mt * 16 * pl.RQ + jt * 16, g[i], pl.RQ, wmma::mem_row_major);
  }
}

// Second launch: G from the partials, then dV and C (the last block: dcodes).
template <typename T>
__global__ void __launch_bounds__(kThreads) grads_v_kernel(LowRankGradArgs p, GradFlags f) {
  extern __shared__ __align__(128) unsigned char smem[];
  const Plan pl(p.M, p.r);
  const Smem<T> s(smem, pl);
  const int M = p.M, r = p.r, warp = threadIdx.x / 32, lane = threadIdx.x % 32;
  const T* codes = static_cast<const T*>(p.codes);
  const bool dcodes_block = (int)blockIdx.x == f.v_blocks;
  const int row0 = blockIdx.x * kRows;
  if (!dcodes_block) {  // X's columns and V's rows travel while G is summed
    stage_slice(s.slice, pl.ld_s, static_cast<const T*>(p.X), M, pl.MP, p.K, row0, f.vec_x);
    stage_rows(s.rows, pl.ld_w, static_cast<const T*>(p.V), p.K, r, pl.RQ, row0, f.vec_v);
    cp_async_commit();
  }

  // G, four values a thread (MP RQ is a multiple of 256), every partial's load in flight at once: this
  // sum is bound by the round trip, not by bytes.
  const int count = pl.MP * pl.RQ;
  for (int e0 = threadIdx.x * 4; e0 < count; e0 += kThreads * 4) {
    float g[4] = {};
#pragma unroll
    for (int q = 0; q < kMaxPartials; ++q) {  // fixed order: the result does not depend on timing
      if (q < f.u_blocks) {
        const float4 v = __ldcg(reinterpret_cast<const float4*>(p.ws + (size_t)q * count + e0));
        g[0] += v.x, g[1] += v.y, g[2] += v.z, g[3] += v.w;
      }
    }
#pragma unroll
    for (int u = 0; u < 4; ++u) {
      const int m = (e0 + u) / pl.RQ, j = (e0 + u) % pl.RQ;
      const bool valid = m < M && j < r;
      if (valid && dcodes_block)
        static_cast<T*>(p.dcodes)[m * r + j] = from_acc<T>(p.scale * g[u] * p.P[(size_t)m * r + j]);
      const float c = valid && codes ? to_acc(codes[(size_t)m * r + j]) : 1.f;
      s.coef[m * pl.ld_c + j] = from_acc<T>(valid ? p.scale * g[u] * c : 0.f);
    }
  }
  if (dcodes_block) return;
  cp_async_wait<0>();
  __syncthreads();
  write_grad_rows(static_cast<T*>(p.dV), s.slice, s.coef, s.stage, pl, p.K, r, row0, f.vec_out);

  // C[:, the warp's 16 columns] = coef · V rows^T, 16 tokens at a time
  T* C = static_cast<T*>(p.C);
  const int k0 = row0 + 16 * warp;
  for (int mt = 0; mt < pl.MP / 16; ++mt) {
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc;
    wmma::fill_fragment(acc, 0.f);
    for (int jt = 0; jt < pl.RQ / 16; ++jt) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;  // V rows: (k, j)
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b;  // coef^T: (j, m)
      wmma::load_matrix_sync(a, s.rows + 16 * warp * pl.ld_w + jt * 16, pl.ld_w);
      wmma::load_matrix_sync(b, s.coef + mt * 16 * pl.ld_c + jt * 16, pl.ld_c);
      wmma::mma_sync(acc, a, b, acc);
    }
    wmma::store_matrix_sync(s.stage, acc, Plan::stage_ld, wmma::mem_col_major);  // stage[m][k]
    __syncwarp();
    for (int i = lane; i < 256; i += 32) {  // half a warp per token: 16 consecutive columns of C
      const int m = mt * 16 + i / 16, k = k0 + i % 16;
      if (m < M && k < p.K) C[(size_t)m * p.K + k] = from_acc<T>(s.stage[(i / 16) * Plan::stage_ld + i % 16]);
    }
    __syncwarp();
  }
}

template <typename T, bool First>
cudaError_t launch_typed(const LowRankGradArgs& a, const GradFlags& f, cudaStream_t stream) {
  auto kernel = First ? grads_u_kernel<T> : grads_v_kernel<T>;
  const int bytes = Plan(a.M, a.r).bytes();
  if (bytes > 48 * 1024) {
    cudaError_t err = raise_smem_limit<First ? grads_u_kernel<T> : grads_v_kernel<T>>(
        Plan(kDecodeMaxTokens, kMaxFusedRank).bytes());
    if (err != cudaSuccess) return err;
  }
  kernel<<<First ? f.u_blocks : f.v_blocks + 1, kThreads, bytes, stream>>>(a, f);
  return cudaGetLastError();
}

GradFlags grad_flags(const LowRankGradArgs& a) {
  GradFlags f;
  f.u_chunks = (a.N + kRows - 1) / kRows;
  f.u_blocks = lowrank_grads_partials_of(a.N);
  f.v_blocks = (a.K + kRows - 1) / kRows;
  f.vec_x = a.K % 8 == 0 && aligned16(a.X);
  f.vec_dy = a.N % 8 == 0 && aligned16(a.dY);
  f.vec_u = a.r % 8 == 0 && aligned16(a.U);
  f.vec_v = a.r % 8 == 0 && aligned16(a.V);
  f.vec_out = a.r % 8 == 0 && aligned16(a.dV) && aligned16(a.dU);
  return f;
}

template <bool First>
cudaError_t launch(DType dtype, const LowRankGradArgs& a, cudaStream_t stream) {
  if (a.M < 1 || a.M > kDecodeMaxTokens || a.r < 1 || a.r > kMaxFusedRank) return cudaErrorInvalidValue;
  const GradFlags f = grad_flags(a);
  return dispatch_half(dtype, [&](auto tag) { return launch_typed<typename decltype(tag)::type, First>(a, f, stream); });
}

}  // namespace

int64_t lowrank_grads_workspace(int M, int N, int r) {
  return (int64_t)lowrank_grads_partials_of(N) * round_up(M, 16) * round_up(r, 16);
}

cudaError_t launch_lowrank_grads_first(DType dtype, const LowRankGradArgs& args, cudaStream_t stream) {
  return launch<true>(dtype, args, stream);
}

cudaError_t launch_lowrank_grads_second(DType dtype, const LowRankGradArgs& args, cudaStream_t stream) {
  return launch<false>(dtype, args, stream);
}

}  // namespace bem
