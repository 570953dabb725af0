// The BEM linear at 1-4 tokens on a row-major weight, on CUDA cores (sm_90, W row-major, M <=
// kDecodeGemvMaxTokens, K % 8 == 0, r <= 64), in two launches:
//
//     Z = X W^T                        (decode_gemv_kernel: fp32, M x N)
//     Y = Z + b + (s (X V) ⊙ codes) U^T  (decode_gemv_update_kernel)
//
// At a few tokens each row of W is a few dot products, and the call is bound by reading W once. The simplest
// layout measured fastest (scripts/gemv_probe.cu, a plain matrix-vector product, H100, CUDA-graph replays, W
// rotated past L2): blocks of 8 warps, a warp a row over all of K, each lane with 8 of the row's 16-byte pieces
// in flight, x read through L1, and many small blocks resident at once; at one token 12.5 µs against cuBLAS's
// 13.6 at 2048 -> 8192 and 0.73-0.93x cuBLAS's time on the six shapes it measured, where the tensor-core decode
// kernels took about 18.5 µs. So the first launch is that alone. A form that waited inside it for a projection
// launched before it (to add the update in the same pass) was slower (17.1 µs at 2048 -> 8192): its first wave
// of blocks held their multiprocessors while the projection finished.
//
// The second launch is a programmatic dependent launch of up to 32 blocks: once every block of the first has
// started, each of its blocks computes the whole s (X V) ⊙ codes (rounded to the input dtype, as PyTorch rounds
// it) and reads its rows' U and bias while the stream finishes, then waits for it (griddepcontrol.wait) and
// writes Y, each output one fixed-order fp32 sum rounded once: two calls give the same bits.

#include "decode_projection.cuh"

namespace bem {
namespace {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvLoads = 8;           // 16-byte pieces of its row a lane has in flight (4 KB a warp)
constexpr int kUpdateBlocks = 32;       // the second launch's blocks at most (each computes X V for itself)
constexpr int kUpdateThreads = 256;

// Read once: no L1 allocation (the probe's fastest form; the 128- or 256-byte L2 hints gained nothing).
__device__ __forceinline__ uint4 ld_weight16(const uint4* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

template <typename T>
__device__ __forceinline__ void dot8(const uint4& w, const uint4& x, float (&acc)[2]) {
  float wf[8], xf[8];
  unpack8<T>(w, wf);
  unpack8<T>(x, xf);
#pragma unroll
  for (int i = 0; i < 8; i += 2) {
    acc[0] = fmaf(wf[i], xf[i], acc[0]);
    acc[1] = fmaf(wf[i + 1], xf[i + 1], acc[1]);
  }
}

// Z = X W^T in fp32 (p.ws, M x N). MT: tokens (1, 2 or 4; rows of X past M are never read).
template <typename T, int MT>
__global__ void __launch_bounds__(kGemvThreads) decode_gemv_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  launch_dependents();  // the update launch may start once every block of this one has
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (n >= p.N) return;  // no barrier below: a warp past N just leaves
  const int M = p.M, vecs = p.K / 8;
  const uint4* w_row = static_cast<const uint4*>(p.W) + (size_t)n * vecs;
  const uint4* X = static_cast<const uint4*>(p.X);

  float acc[MT][2];
#pragma unroll
  for (int m = 0; m < MT; ++m) acc[m][0] = acc[m][1] = 0.f;
  int v = lane;
  for (; v + 32 * (kGemvLoads - 1) < vecs; v += 32 * kGemvLoads) {  // every load of the batch, then the sums
    uint4 w[kGemvLoads];
#pragma unroll
    for (int u = 0; u < kGemvLoads; ++u) w[u] = ld_weight16(w_row + v + 32 * u);
#pragma unroll
    for (int u = 0; u < kGemvLoads; ++u)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M) dot8<T>(w[u], ld_cached16(X + (size_t)m * vecs + v + 32 * u), acc[m]);
  }
  if (v < vecs) {  // the row's last pieces (fewer than a batch a lane): predicated, still in flight together
    uint4 w[kGemvLoads];
#pragma unroll
    for (int u = 0; u < kGemvLoads; ++u) w[u] = v + 32 * u < vecs ? ld_weight16(w_row + v + 32 * u) : zero4();
#pragma unroll
    for (int u = 0; u < kGemvLoads; ++u)
#pragma unroll
      for (int m = 0; m < MT; ++m)
        if (m < M && v + 32 * u < vecs) dot8<T>(w[u], ld_cached16(X + (size_t)m * vecs + v + 32 * u), acc[m]);
  }
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= M) break;
    float s = acc[m][0] + acc[m][1];
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) p.ws[(size_t)m * p.N + n] = s;
  }
#endif
}

// Y = Z + b + (s (X V) ⊙ codes) U^T, and P = X V (fp32, when p.P is set: block 0 writes it). Block q owns rows
// q, q + G, q + 2G, ... Before the wait only what the first launch does not write is read: X, V, the codes, U, b.
template <typename T>
__global__ void __launch_bounds__(kUpdateThreads) decode_gemv_update_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  constexpr int kMaxRank = kDecodeStreamMaxRank;
  __shared__ float part[kUpdateThreads][8];  // each thread's 8 ranks over its slice of K
  __shared__ float zs[kDecodeGemvMaxTokens * kMaxRank];
  const int M = p.M, N = p.N, K = p.K, r = p.r, tid = threadIdx.x;
  const T* X = static_cast<const T*>(p.X);
  const T* V = static_cast<const T*>(p.V);
  // X V: thread t takes 8 ranks (octet o) of token m over the k = s, s + S, ... of its slice s.
  const int octets = (r + 7) / 8, outputs = M * octets;
  int slices = 1;
  while (slices * 2 * outputs <= kUpdateThreads) slices *= 2;
  const int o = tid / slices, s = tid % slices;
  float z[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
  if (o < outputs) {
    const int m = o / octets, j0 = 8 * (o % octets);
    const bool rows16 = r % 8 == 0 && (reinterpret_cast<uintptr_t>(V) & 15) == 0;
    for (int k = s; k < K; k += slices) {
      const float xk = to_acc(X[(size_t)m * K + k]);
      if (rows16) {
        float vf[8];
        unpack8<T>(ld_cached16(V + (size_t)k * r + j0), vf);
#pragma unroll
        for (int i = 0; i < 8; ++i) z[i] = fmaf(xk, vf[i], z[i]);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (j0 + i < r) z[i] = fmaf(xk, to_acc(V[(size_t)k * r + j0 + i]), z[i]);
      }
    }
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) part[tid][i] = z[i];
  __syncthreads();
  const T* codes = static_cast<const T*>(p.codes);
  for (int i = tid; i < M * r; i += kUpdateThreads) {  // the slices' sums in order
    const int m = i / r, j = i % r, first = (m * octets + j / 8) * slices;
    float sum = 0.f;
    for (int q = 0; q < slices; ++q) sum += part[first + q][j % 8];
    if (p.P && blockIdx.x == 0) p.P[i] = sum;
    zs[m * kMaxRank + j] = to_acc(from_acc<T>(sum * p.scale * (codes ? to_acc(codes[i]) : 1.f)));
  }
  __syncthreads();

  // A thread a row at a time (rows tid, tid + threads of the grid, ...): U's row against zs, its bias, then after
  // the wait Z's value and the sum. A warp a row here was slower than the stream itself: each warp walked 64 rows
  // of a 2048 -> 8192 matrix one dependent load after another.
  const T* U = static_cast<const T*>(p.U);
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  const bool u_rows16 = r % 8 == 0 && (reinterpret_cast<uintptr_t>(U) & 15) == 0;
  bool waited = false;
  for (int n = blockIdx.x * kUpdateThreads + tid; n < N; n += gridDim.x * kUpdateThreads) {
    float t[kDecodeGemvMaxTokens] = {0.f, 0.f, 0.f, 0.f};
    const T* u_row = U + (size_t)n * r;
    for (int j0 = 0; j0 < r; j0 += 8) {
      float uf[8];
      if (u_rows16) {
        unpack8<T>(ld_cached16(u_row + j0), uf);
      } else {
#pragma unroll
        for (int i = 0; i < 8; ++i) uf[i] = j0 + i < r ? to_acc(u_row[j0 + i]) : 0.f;
      }
#pragma unroll
      for (int m = 0; m < kDecodeGemvMaxTokens; ++m)
#pragma unroll
        for (int i = 0; i < 8; ++i)
          if (m < M && j0 + i < r) t[m] = fmaf(uf[i], zs[m * kMaxRank + j0 + i], t[m]);
    }
    const float b = bias ? to_acc(bias[n]) : 0.f;
    if (!waited) {
      wait_for_prerequisite();  // Z is complete and visible
      waited = true;
    }
#pragma unroll
    for (int m = 0; m < kDecodeGemvMaxTokens; ++m)
      if (m < M) Y[(size_t)m * N + n] = from_acc<T>(p.ws[(size_t)m * N + n] + b + t[m]);
  }
#endif
}

template <typename T, int MT>
cudaError_t launch_gemv(const DecodeArgs& a, cudaStream_t stream) {
  const int row_blocks = (a.N + kGemvWarps - 1) / kGemvWarps;
  decode_gemv_kernel<T, MT><<<row_blocks, kGemvThreads, 0, stream>>>(a);
  cudaError_t err = cudaGetLastError();
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  const int update_blocks = (a.N + kUpdateThreads - 1) / kUpdateThreads;
  config.gridDim = dim3(update_blocks < kUpdateBlocks ? update_blocks : kUpdateBlocks, 1, 1);
  config.blockDim = dim3(kUpdateThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute;  // may start while the first launch still runs
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, decode_gemv_update_kernel<T>, a);
}

}  // namespace

bool decode_gemv_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && !a.w_transposed && a.M >= 1 && a.M <= kDecodeGemvMaxTokens && a.K >= 8 && a.K % 8 == 0 &&
         a.r >= 1 && a.r <= kDecodeStreamMaxRank && aligned16(a.X) && aligned16(a.W);
}

bool decode_gemv_takes(const DecodeArgs& a) {
  // Under capture, at one token, above the row kernel's shapes: there the row kernel (one launch) measured
  // 0.97-1.06x F.linear, and this kernel's two launches cost more than its stream saves; on the large matrices
  // the tensor-core decode kernels took about 18.5 µs at 2048 -> 8192, the probe's plain form 12.5.
  return a.M == 1 && !decode_rows_takes(a.N, a.K);
}

cudaError_t launch_decode_gemv(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.M < 1 || args.M > kDecodeGemvMaxTokens || args.K % 8 != 0 || args.r > kDecodeStreamMaxRank ||
      args.ws == nullptr)
    return cudaErrorInvalidValue;
  static_assert(kDecodeGemvMaxTokens == 4, "forms for 1, 2 and 4 tokens");
  return dispatch_half(dtype, [&](auto t) {
    using T = typename decltype(t)::type;
    return args.M == 1 ? launch_gemv<T, 1>(args, stream)
           : args.M == 2 ? launch_gemv<T, 2>(args, stream)
                         : launch_gemv<T, 4>(args, stream);
  });
}

}  // namespace bem
