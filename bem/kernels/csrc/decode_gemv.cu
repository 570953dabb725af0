// The BEM linear at 1-4 tokens on a row-major weight, on CUDA cores, after the projection launch (sm_90,
// W row-major, M <= kDecodeGemvMaxTokens, K % 8 == 0, r <= 64):
//
//     Y = X W^T + b + Pc U^T,    Pc = s (X V) ⊙ codes    (decode_project_kernel, launched just before)
//
// At a few tokens each row of W is a few dot products, and the call is bound by reading W once. The simplest
// layout measured fastest (scripts/gemv_probe.cu, a plain matrix-vector product, H100, CUDA-graph replays, W
// rotated past L2): blocks of 8 warps, a warp a row over all of K, each lane with 8 of the row's 16-byte pieces
// in flight, x read through L1, and many small blocks resident at once; at one token 12.5 µs against cuBLAS's
// 13.6 at 2048 -> 8192, 0.73-0.93x cuBLAS's time on the six shapes it measured, where the tensor-core decode
// kernels (one CUDA-core warp's work spread over 16-row fragments, clusters that split K) took about 18.5 µs.
//
// The update's coefficients come from the projection launch before this one: this grid is a programmatic
// dependent launch, so it streams W while the projection runs and waits for it (griddepcontrol.wait) only
// before reading Pc. Each lane adds U[n][j] Pc[m][j] for its j (and j + 32) to its share of the row's sum before
// one warp reduction, so every output is one fixed-order fp32 sum rounded once: two calls give the same bits.

#include "decode_projection.cuh"

namespace bem {
namespace {

constexpr int kGemvWarps = 8;
constexpr int kGemvThreads = 32 * kGemvWarps;
constexpr int kGemvLoads = 8;  // 16-byte pieces of its row a lane has in flight (4 KB a warp)

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

// MT: tokens (1, 2 or 4; rows of X past M are never read).
template <typename T, int MT>
__global__ void __launch_bounds__(kGemvThreads) decode_gemv_kernel(DecodeArgs p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  const int lane = threadIdx.x % 32;
  const int n = blockIdx.x * kGemvWarps + threadIdx.x / 32;
  if (n >= p.N) return;  // no barrier below: a warp past N just leaves
  const int M = p.M, K = p.K, r = p.r, vecs = K / 8;
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

  const T* U = static_cast<const T*>(p.U) + (size_t)n * r;
  const float u0 = lane < r ? to_acc(U[lane]) : 0.f, u1 = lane + 32 < r ? to_acc(U[lane + 32]) : 0.f;
  const float b = p.bias ? to_acc(static_cast<const T*>(p.bias)[n]) : 0.f;
  wait_for_prerequisite();  // the projection launch's Pc is complete and visible
  const T* Pc = static_cast<const T*>(p.Pc);
  const int rp = round_up(r, 16);
  T* Y = static_cast<T*>(p.Y);
#pragma unroll
  for (int m = 0; m < MT; ++m) {
    if (m >= M) break;
    float s = acc[m][0] + acc[m][1];
    if (lane < r) s += u0 * to_acc(Pc[m * rp + lane]);
    if (lane + 32 < r) s += u1 * to_acc(Pc[m * rp + lane + 32]);
#pragma unroll
    for (int off = 16; off >= 1; off >>= 1) s += __shfl_xor_sync(0xffffffffu, s, off);
    if (lane == 0) Y[(size_t)m * p.N + n] = from_acc<T>(s + b);
  }
#endif
}

template <typename T, int MT>
cudaError_t launch_gemv(const DecodeArgs& a, cudaStream_t stream) {
  const int blocks = project_blocks(a.K);
  cudaLaunchAttribute project_cluster;
  const cudaLaunchConfig_t project =
      cluster_launch_config(dim3(blocks, 1, 1), kThreads, 0, stream, blocks, project_cluster);
  cudaError_t err = cudaLaunchKernelEx(&project, decode_project_kernel<T, 1>, a);
  if (err != cudaSuccess) return err;
  cudaLaunchConfig_t config = {};
  config.gridDim = dim3((a.N + kGemvWarps - 1) / kGemvWarps, 1, 1);
  config.blockDim = dim3(kGemvThreads, 1, 1);
  config.stream = stream;
  cudaLaunchAttribute attribute;  // may start while the projection still runs
  attribute.id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attribute.val.programmaticStreamSerializationAllowed = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return cudaLaunchKernelEx(&config, decode_gemv_kernel<T, MT>, a);
}

}  // namespace

bool decode_gemv_fits(const DecodeArgs& a, int cc_major) {
  return cc_major >= 9 && !a.w_transposed && a.M >= 1 && a.M <= kDecodeGemvMaxTokens && a.K >= 8 && a.K % 8 == 0 &&
         a.r >= 1 && a.r <= kDecodeStreamMaxRank && aligned16(a.X) && aligned16(a.W);
}

bool decode_gemv_takes(int M) {
  // Under capture, at one token: 2048 -> 8192 (Llama-1B's gate and up) took about 18.5 µs in the tensor-core
  // decode kernels where the probe's plain form took 12.5 (scripts/gemv_probe.cu).
  return M == 1;
}

cudaError_t launch_decode_gemv(DType dtype, const DecodeArgs& args, cudaStream_t stream) {
  if (args.M < 1 || args.M > kDecodeGemvMaxTokens || args.K % 8 != 0 || args.r > kDecodeStreamMaxRank ||
      args.Pc == nullptr)
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
