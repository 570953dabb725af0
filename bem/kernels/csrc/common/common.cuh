// Shared helpers for the BEM kernels: dtype conversion, 16-byte async copies, tile geometry, and the
// host-side shared-memory limit.
// Kept free of torch headers so the kernels compile (and can be inspected) with nvcc alone.
#pragma once

#include <cuda_runtime.h>
#include <cuda_fp16.h>
#include <cuda_bf16.h>
#include <mma.h>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <mutex>
#include <tuple>
#include <type_traits>

#include "dtype.h"

namespace bem {

template <typename T> struct Acc { using type = float; };
template <> struct Acc<double> { using type = double; };

__device__ __forceinline__ float to_acc(__half v) { return __half2float(v); }
__device__ __forceinline__ float to_acc(__nv_bfloat16 v) { return __bfloat162float(v); }
__device__ __forceinline__ float to_acc(float v) { return v; }
__device__ __forceinline__ double to_acc(double v) { return v; }

template <typename T> __device__ __forceinline__ T from_acc(float v);
template <> __device__ __forceinline__ __half from_acc<__half>(float v) { return __float2half_rn(v); }
template <> __device__ __forceinline__ __nv_bfloat16 from_acc<__nv_bfloat16>(float v) { return __float2bfloat16_rn(v); }
template <> __device__ __forceinline__ float from_acc<float>(float v) { return v; }
template <typename T> __device__ __forceinline__ T from_acc_d(double v);
template <> __device__ __forceinline__ double from_acc_d<double>(double v) { return v; }
template <> __device__ __forceinline__ float from_acc_d<float>(double v) { return static_cast<float>(v); }

// 16-byte global->shared copy that bypasses L1; with valid == false it writes 16 zero bytes
// (src-size 0), which is how out-of-range rows and columns of a tile become zeros. L2 fetches the
// whole 128-byte line, so a thread's next copies along the same row hit L2: the streaming decode
// kernel reads W 64 bytes per row per copy, and measured 5-15% faster with this hint (M = 1, 4096²
// r = 8: 1.26x -> 1.18x F.linear; 4096 x 14336: 1.44x -> 1.23x); the tiles kernels did not change.
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, bool valid) {
  const unsigned dst = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  const int src_bytes = valid ? 16 : 0;
  asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;\n" ::"r"(dst), "l"(gmem), "r"(src_bytes));
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int Pending> __device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(Pending));
}

// Shared-memory rows are padded by 8 16-bit elements (16 bytes) to spread rows over the banks.
constexpr int kPad = 8;

__host__ __device__ constexpr int round_up(int v, int m) { return (v + m - 1) / m * m; }
__host__ __device__ constexpr int cmax(int a, int b) { return a > b ? a : b; }

// 8 consecutive 16-bit values moved as one 16-byte word.
struct alignas(16) Vec8 { uint4 raw; };

template <typename T> __device__ __forceinline__ void unpack8(const uint4& raw, float out[8]) {
  const T* v = reinterpret_cast<const T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) out[i] = to_acc(v[i]);
}
template <typename T> __device__ __forceinline__ uint4 pack8(const float in[8]) {
  uint4 raw;
  T* v = reinterpret_cast<T*>(&raw);
#pragma unroll
  for (int i = 0; i < 8; ++i) v[i] = from_acc<T>(in[i]);
  return raw;
}

// The backward's coefficients at index i from fp32 G = dY U and P = x V and the code c, rounded to the
// operands' dtype as the composed PyTorch backward rounds them: s G ⊙ c (for dV), s P ⊙ c (for dU) and
// s G ⊙ P (dcodes).
template <typename T>
__device__ __forceinline__ void store_coefficients(float G, float P, float c, float scale, size_t i, T* g_c, T* p_c,
                                                   T* g_p) {
  const float g = scale * G;
  g_c[i] = from_acc<T>(g * c);
  p_c[i] = from_acc<T>(scale * P * c);
  g_p[i] = from_acc<T>(g * P);
}

// ---- register-direct tensor-core helpers (mma.sync m16n8k16, sm_80+) ----
//
// A 16-byte load of 8 consecutive k values per thread feeds two m16n8k16 steps directly from
// registers: thread (group g = lane / 4, c = lane % 4) holds k = 8c .. 8c+7 of its row; words 0-1 are
// the step-1 fragment (logical k pairs 2c and 2c+8) and words 2-3 the step-2 one. The sum over k does
// not care which physical k a logical k stands for, as long as both operands use the same map.

__device__ __forceinline__ uint4 zero4() { return make_uint4(0, 0, 0, 0); }

// Read-once streaming load (activations of the update kernel): no L1 allocation, and L2 fetches the
// whole 128-byte line, which the thread's next loads along the row then hit (update alone at
// M = 16384, 4096², r = 8: 65% -> 70% of copy).
__device__ __forceinline__ uint4 ld_stream16(const void* p) {
  uint4 v;
  asm("ld.global.nc.L1::no_allocate.L2::128B.v4.u32 {%0, %1, %2, %3}, [%4];\n"
      : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}
// Reused read-only load (activations, adapter weights): through L1.
__device__ __forceinline__ uint4 ld_cached16(const void* p) { return __ldg(reinterpret_cast<const uint4*>(p)); }

// v[0..8) (+ bias[0..8)) (+ the 8 values already at dst) written to dst as one 16-byte store.
template <typename T>
__device__ __forceinline__ void store8(T* dst, float (&v)[8], const T* bias, bool accumulate) {
  float extra[8];
  if (bias) {
    unpack8<T>(ld_cached16(bias), extra);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] += extra[e];
  }
  if (accumulate) {
    unpack8<T>(*reinterpret_cast<const uint4*>(dst), extra);
#pragma unroll
    for (int e = 0; e < 8; ++e) v[e] += extra[e];
  }
  *reinterpret_cast<uint4*>(dst) = pack8<T>(v);
}

// D += A B for one m16n8k16 tile, fp32 accumulation. a: 4 words (rows g, g+8 x k pairs lo, hi as
// {row g lo, row g+8 lo, row g hi, row g+8 hi}); b: 2 words (column g, k pairs lo, hi).
template <typename T>
__device__ __forceinline__ void mma_16816(float (&d)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                          uint32_t b0, uint32_t b1) {
  if constexpr (std::is_same<T, __nv_bfloat16>::value) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  } else {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
  }
}

// 8x8 16-bit tiles from shared memory: lanes 8i..8i+7 give the row addresses of tile i, and thread
// (g, c) receives as word i tile i's (row g, columns 2c, 2c + 1), or with .trans its (rows 2c, 2c + 1,
// column g). Two tiles: lanes 0-15 give the addresses (the others' are ignored but must be valid).
__device__ __forceinline__ uint4 ldmatrix_x4(unsigned address) {
  uint4 v;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}
__device__ __forceinline__ uint4 ldmatrix_x4_trans(unsigned address) {
  uint4 v;
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "r"(address));
  return v;
}
__device__ __forceinline__ uint2 ldmatrix_x2_trans(unsigned address) {
  uint2 v;
  asm volatile("ldmatrix.sync.aligned.m8n8.x2.trans.shared.b16 {%0, %1}, [%2];\n"
               : "=r"(v.x), "=r"(v.y) : "r"(address));
  return v;
}
__device__ __forceinline__ unsigned smem_address(const void* p) {
  return static_cast<unsigned>(__cvta_generic_to_shared(p));
}

// Two 16-bit values as one mma operand word (lo in the low half).
template <typename T> __device__ __forceinline__ uint32_t pack2(T lo, T hi) {
  uint16_t l, h;
  memcpy(&l, &lo, 2);
  memcpy(&h, &hi, 2);
  return (uint32_t)l | ((uint32_t)h << 16);
}

// The fixed-order sum over a thread-block cluster's first cs (<= MaxBlocks) blocks of buf[i] in each
// block's shared memory; every remote read is issued before the first add, so their latencies overlap.
// (A template: cluster groups exist only in the sm_90 pass of the compiler, and an sm_80 build must still
// compile this file.)
template <int MaxBlocks, typename Cluster>
__device__ __forceinline__ float cluster_sum(Cluster& cluster, float* buf, int i, int cs) {
  float part[MaxBlocks];
#pragma unroll
  for (int s = 0; s < MaxBlocks; ++s) part[s] = s < cs ? cluster.map_shared_rank(buf, s)[i] : 0.f;
  float sum = part[0];
#pragma unroll
  for (int s = 1; s < MaxBlocks; ++s)
    if (s < cs) sum += part[s];
  return sum;
}

// ---- host side ----

template <typename T> struct TypeTag { using type = T; };

// launch(TypeTag<T>{}) with T the 16-bit type named by dtype; fp32/fp64: cudaErrorInvalidValue.
template <typename Launch>
cudaError_t dispatch_half(DType dtype, Launch&& launch) {
  switch (dtype) {
    case DType::kHalf: return launch(TypeTag<__half>{});
    case DType::kBFloat16: return launch(TypeTag<__nv_bfloat16>{});
    default: return cudaErrorInvalidValue;
  }
}

// A launch of `grid` in thread-block clusters of `cluster_x` blocks along x (sm_90); `attribute` holds the
// cluster's size and must outlive the cudaLaunchKernelEx call.
inline cudaLaunchConfig_t cluster_launch_config(dim3 grid, int threads, size_t smem_bytes, cudaStream_t stream,
                                                int cluster_x, cudaLaunchAttribute& attribute) {
  cudaLaunchConfig_t config = {};
  config.gridDim = grid;
  config.blockDim = dim3(threads, 1, 1);
  config.dynamicSmemBytes = smem_bytes;
  config.stream = stream;
  attribute.id = cudaLaunchAttributeClusterDimension;
  attribute.val.clusterDim.x = cluster_x;
  attribute.val.clusterDim.y = 1;
  attribute.val.clusterDim.z = 1;
  config.attrs = &attribute;
  config.numAttrs = 1;
  return config;
}

// Raises Kernel's dynamic shared-memory limit to `bytes`, once per device: a driver call per launch
// costs at decode sizes. Each kernel (the template argument) keeps its own flags.
template <auto Kernel>
cudaError_t raise_smem_limit(int bytes) {
  static std::atomic<unsigned long long> raised{0};  // one bit per device (devices 64 and up: every call)
  int device = 0;
  cudaError_t err = cudaGetDevice(&device);
  if (err != cudaSuccess) return err;
  const unsigned long long bit = device < 64 ? 1ull << device : 0;
  if (raised.load() & bit) return cudaSuccess;
  err = cudaFuncSetAttribute(Kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
  if (err == cudaSuccess) raised.fetch_or(bit);
  return err;
}

// How many clusters of `cs` blocks of `kernel` the device runs at once: clusters live inside one GPC, so this
// is less than (blocks per multiprocessor x multiprocessors) / cs, and a grid with more clusters than this
// runs a second wave. Read once per (device, kernel, cs): `configure` fills the launch config to ask about
// (and may raise the kernel's shared-memory limit first); on any error 0, planning as if nothing were
// resident.
inline int resident_clusters_of(const void* kernel, int device, int cs,
                                const std::function<cudaError_t(cudaLaunchConfig_t&, cudaLaunchAttribute*)>& configure) {
  static std::mutex lock;
  static std::map<std::tuple<int, const void*, int>, int> cache;
  std::lock_guard<std::mutex> guard(lock);
  const auto key = std::make_tuple(device, kernel, cs);
  const auto found = cache.find(key);
  if (found != cache.end()) return found->second;
  int clusters = 0;
  cudaLaunchAttribute attribute[2];
  cudaLaunchConfig_t config = {};
  if (configure(config, attribute) != cudaSuccess ||
      cudaOccupancyMaxActiveClusters(&clusters, kernel, &config) != cudaSuccess) {
    cudaGetLastError();  // not sticky: clear it
    clusters = 0;
  }
  cache[key] = clusters;
  return clusters;
}

// The largest thread-block cluster (K split) of 8, 4 or 2 blocks whose slice of K keeps at least `min_slice`
// rows and whose grid of `tiles` clusters runs in one wave (`resident(cs)`: clusters of cs blocks resident at
// once); else 1. The split rule of the decode kernels that split K over a cluster.
template <typename Resident>
int largest_one_wave_cluster(int K, int min_slice, int tiles, int max_cluster, Resident&& resident) {
  for (int cs = max_cluster; cs > 1; cs /= 2)
    if (K / cs >= min_slice && tiles <= resident(cs)) return cs;
  return 1;
}

}  // namespace bem
