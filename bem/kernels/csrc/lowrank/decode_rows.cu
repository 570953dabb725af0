// The BEM linear at decode sizes on small matrices, one launch without clusters (sm_90, W row-major,
// M <= 16 tokens, K <= 2048 and a multiple of 8, r <= 64):
//
//     Y = X W^T + b + s * ((X V) ⊙ codes) U^T
//
// A small matrix's decode step is latency, not bytes: each thread of the streaming kernel (decode_stream.cu)
// has a handful of copies of W to make, and what it costs beyond cuBLAS's GEMV is its fixed chain of steps
// (a cluster launch, the cluster barriers, the sums through distributed shared memory). Here a block owns
// 16 rows of W over all of K and its eight warps split K between them (warp w takes the 32-column chunks
// w, w + 8, ...: at most CH each), so the partial sums meet in the block's own shared memory after one
// barrier. Every load is requested before the first result is used, into registers (W, then x, then V's
// rows, then U's rows, the codes and the bias), so the block waits for memory about once. Every block
// computes the whole of X V itself (SliceProjection, as the streaming kernel's in-block form does for its
// slice): V is r / 16 of the block's bytes of W, read from L2 after the first block.
//
// The launch may start before the previous kernel on the stream has finished (programmatic dependent
// launch): before it waits for that kernel, each thread only prefetches its lines of W into L2. L2 is
// coherent, so a prefetch of a line the previous kernel still writes is harmless, where an early load
// would not be; every read of anything (X, V, U, the codes, the bias, and W itself) comes after the wait.

#include <cstdlib>

#include "decode_projection.cuh"

namespace bem {
namespace {

constexpr int kRows = 16;       // rows of W a block
constexpr int kMaxRank = kDecodeStreamMaxRank;

// NT: 8-token tiles (1: M <= 8, 2: M <= 16); CH: chunks of 32 columns a warp at most (K <= 256 CH).
template <typename T, int NT, int CH>
__global__ void __launch_bounds__(kThreads) decode_rows_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kTok = 8 * NT;
  constexpr int kUPer = (kRows * kMaxRank + kThreads - 1) / kThreads;  // U's rows a thread holds
  constexpr int kCPer = (kTok * kMaxRank + kThreads - 1) / kThreads;   // codes a thread holds
  __shared__ __align__(16) unsigned char stage[kWarps][512];           // SliceProjection's staging tiles
  __shared__ float zpart[kWarps * kPartFloats];                        // [warp part][16 tokens][8 ranks]
  __shared__ float ypart[kWarps][kTok][kRows];                         // each warp's partial X W^T
  __shared__ float zc[kTok][kMaxRank];                                 // s (X V) ⊙ codes
  __shared__ float us[kRows * kMaxRank];                               // U's rows
  __shared__ float bs[kRows];

  const T* X = static_cast<const T*>(p.X);
  const T* W = static_cast<const T*>(p.W);
  const T* U = static_cast<const T*>(p.U);
  const T* codes = static_cast<const T*>(p.codes);
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int tid = threadIdx.x, warp = tid / 32, lane = tid % 32, g = lane / 4, c = lane % 4;
  const int n0 = blockIdx.x * kRows;

  // This thread's rows of W (g and g + 8 of the block's 16) at k = 8c of each of its warp's chunks.
  const bool wok0 = n0 + g < N, wok1 = n0 + g + 8 < N;
  const T* w0 = W + (size_t)(wok0 ? n0 + g : 0) * K + 8 * c;
  const T* w1 = W + (size_t)(wok1 ? n0 + g + 8 : 0) * K + 8 * c;
  bool in[CH];
  const auto chunk_k = [warp](int i) { return (warp + i * kWarps) * kChunk; };  // this warp's i-th chunk
#pragma unroll
  for (int i = 0; i < CH; ++i) in[i] = chunk_k(i) + 8 * c < K;  // K % 8 == 0: all 8 or none
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int k = chunk_k(i);
    if (in[i] && wok0) prefetch_l2(w0 + k);
    if (in[i] && wok1) prefetch_l2(w1 + k);
  }
  wait_for_prerequisite();

  uint4 wa[CH], wb[CH], xa[CH], xb[CH];
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int k = chunk_k(i);
    wa[i] = in[i] && wok0 ? ld_stream16(w0 + k) : zero4();
    wb[i] = in[i] && wok1 ? ld_stream16(w1 + k) : zero4();
  }
  const bool x_ok0 = g < M, x_ok1 = g + 8 < M;
  const T* x0 = X + (size_t)(x_ok0 ? g : 0) * K + 8 * c;
  const T* x1 = X + (size_t)(x_ok1 ? g + 8 : 0) * K + 8 * c;
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    const int k = chunk_k(i);
    xa[i] = in[i] && x_ok0 ? ld_cached16(x0 + k) : zero4();
    xb[i] = NT == 2 && in[i] && x_ok1 ? ld_cached16(x1 + k) : zero4();
  }
  // X V: at ranks up to 8 the warps split K for it as for W (SliceProjection's kparts == kWarps), so each
  // warp's X V takes the x fragments it already holds and only V's rows are loaded here; at higher ranks
  // each warp has its own chunks, loaded in batches after X W^T's operands are used.
  const SliceProjection<T, NT> proj(p, 0, K, stage[warp]);
  const bool shares_x = proj.kparts == kWarps;
  uint4 pv[CH];
  if (shares_x) {
#pragma unroll
    for (int i = 0; i < CH; ++i) proj.load_v(warp + i * kWarps, pv[i]);
  }
  // The epilogue's small operands, kept as loaded (converted only when stored, so nothing waits on them here).
  T u_raw[kUPer], c_raw[kCPer];
  const T one = from_acc<T>(1.f), zero = from_acc<T>(0.f);
#pragma unroll
  for (int e = 0; e < kUPer; ++e) {  // U[n0 .. n0 + 16) is one contiguous run of 16 r values
    const int i = tid + e * kThreads;
    u_raw[e] = i < kRows * r && n0 + i / r < N ? U[(size_t)n0 * r + i] : zero;
  }
#pragma unroll
  for (int e = 0; e < kCPer; ++e) {
    const int i = tid + e * kThreads;
    c_raw[e] = i < M * r && codes ? codes[i] : one;
  }
  const T b_raw = tid < kRows && n0 + tid < N && bias ? bias[n0 + tid] : zero;

  // ---- This warp's share of X V, where it shares x's fragments ----
  float z[4] = {0.f, 0.f, 0.f, 0.f};
  if (shares_x) {
#pragma unroll
    for (int i = 0; i < CH; ++i) proj.mma(z, xa[i], xb[i], pv[i]);
    proj.store(zpart + warp * kPartFloats, z);
  }

  // ---- This warp's share of X W^T: rows (g, g + 8) x tokens (8s + 2c, + 1) ----
  float acc[NT][4] = {};
#pragma unroll
  for (int i = 0; i < CH; ++i) {
    mma_16816<T>(acc[0], wa[i].x, wb[i].x, wa[i].y, wb[i].y, xa[i].x, xa[i].y);
    mma_16816<T>(acc[0], wa[i].z, wb[i].z, wa[i].w, wb[i].w, xa[i].z, xa[i].w);
    if constexpr (NT == 2) {
      mma_16816<T>(acc[1], wa[i].x, wb[i].x, wa[i].y, wb[i].y, xb[i].x, xb[i].y);
      mma_16816<T>(acc[1], wa[i].z, wb[i].z, wa[i].w, wb[i].w, xb[i].z, xb[i].w);
    }
  }
  if (!shares_x && proj.live) {  // ranks above 8: this warp's own chunks of X V, CH at a time
    for (int q0 = proj.kp; q0 < proj.nchunks; q0 += CH * proj.kparts) {
      uint4 a0[CH], a1[CH], v[CH];
#pragma unroll
      for (int i = 0; i < CH; ++i) proj.load(q0 + i * proj.kparts, a0[i], a1[i], v[i]);
#pragma unroll
      for (int i = 0; i < CH; ++i) proj.mma(z, a0[i], a1[i], v[i]);
    }
    proj.store(zpart + warp * kPartFloats, z);
  }
#pragma unroll
  for (int s = 0; s < NT; ++s) {
    const int m = 8 * s + 2 * c;
    ypart[warp][m][g] = acc[s][0];
    ypart[warp][m + 1][g] = acc[s][1];
    ypart[warp][m][g + 8] = acc[s][2];
    ypart[warp][m + 1][g + 8] = acc[s][3];
  }
#pragma unroll
  for (int e = 0; e < kUPer; ++e) {
    const int i = tid + e * kThreads;
    if (i < kRows * r) us[i] = to_acc(u_raw[e]);
  }
  if (tid < kRows) bs[tid] = to_acc(b_raw);
  __syncthreads();

  // s (X V) ⊙ codes, rounded to the input dtype as PyTorch rounds it; X V itself for the backward.
#pragma unroll
  for (int e = 0; e < kCPer; ++e) {
    const int i = tid + e * kThreads;
    if (i < M * r) {
      const int m = i / r, j = i % r;
      const float z = proj.block_sum(zpart, m, j);
      if (p.P && blockIdx.x == 0) p.P[i] = z;
      zc[m][j] = to_acc(from_acc<T>(z * p.scale * to_acc(c_raw[e])));
    }
  }
  __syncthreads();

  // Each output: the warps' partial sums in a fixed order, then the update and the bias.
  for (int i = tid; i < M * kRows; i += kThreads) {
    const int m = i / kRows, nl = i % kRows, n = n0 + nl;
    if (n >= N) continue;
    float y = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) y += ypart[w][m][nl];
    float update = 0.f;
    for (int j = 0; j < r; ++j) update += us[nl * r + j] * zc[m][j];
    Y[(size_t)m * N + n] = from_acc<T>(y + update + bs[nl]);
  }
#endif
}

// Whether a launch may start before the previous kernel on its stream finishes (read once: a measurement
// switch, BEM_DECODE_ROWS_PDL=0 turns it off).
bool rows_pdl() {
  static const bool on = [] {
    const char* v = std::getenv("BEM_DECODE_ROWS_PDL");
    return v == nullptr || v[0] != '0';
  }();
  return on;
}

template <typename T, int NT, int CH>
cudaError_t launch_rows(const DecodeArgs& a, cudaStream_t stream) {
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.N + kRows - 1) / kRows, 1, 1);
  config.blockDim = dim3(kThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute;
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = rows_pdl() ? 1 : 0;
  return cudaLaunchKernelEx(&config, decode_rows_kernel<T, NT, CH>, a);
}

template <typename T, int NT>
cudaError_t launch_row_chunks(const DecodeArgs& a, cudaStream_t stream) {
  return a.K <= 2 * kWarps * kChunk   ? launch_rows<T, NT, 2>(a, stream)
         : a.K <= 4 * kWarps * kChunk ? launch_rows<T, NT, 4>(a, stream)
         : a.K <= 6 * kWarps * kChunk ? launch_rows<T, NT, 6>(a, stream)
                                       : launch_rows<T, NT, 8>(a, stream);
}

}  // namespace

bool decode_rows_fits(const DecodeArgs& a, int cc_major) {
  return decode_stream_fits(a, cc_major) && a.K <= kDecodeRowsMaxK;  // the streaming kernel's limits, and K's
}

static_assert(kDecodeRowsMaxK == 8 * kWarps * kChunk, "eight chunks a warp at most");

bool decode_rows_takes(int N, int K) {
  // Where the row kernel is the default over the streaming kernel: small matrices, bound by latency.
  return K <= kDecodeRowsMaxK && N <= 4096;
}

cudaError_t launch_decode_rows(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.K > kDecodeRowsMaxK) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return args.M <= 8 ? launch_row_chunks<T, 1>(args, stream) : launch_row_chunks<T, 2>(args, stream);
  });
}

}  // namespace bem
