// gemv_probe_kernels.cuh -- the matrix-vector kernels gemv_probe.cu times (variants A to E, described there):
// their device helpers (streaming loads, mbarrier and bulk-copy PTX) and the kernels themselves.
#pragma once

#include <cuda_bf16.h>
#include <cuda_runtime.h>

#include <cstdint>

typedef __nv_bfloat16 bf16;

// ------------------------------------------------------------------------------------------------
// Device helpers
// ------------------------------------------------------------------------------------------------
// Streaming 16-byte load: read-only path, do not allocate in L1 (W is touched exactly once).
// Not volatile: lets the compiler batch the U*R loads of one iteration.
template <bool PF256>
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
  uint4 v;
  if (PF256)  // same, plus a hint to fetch the surrounding 256-byte L2 sector group
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  else
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
  return v;
}

// bf16 -> fp32 is a 16-bit shift; the two halves of a 32-bit word are (lo, hi).
__device__ __forceinline__ float bf_lo(uint32_t v) { return __uint_as_float(v << 16); }
__device__ __forceinline__ float bf_hi(uint32_t v) { return __uint_as_float(v & 0xffff0000u); }
// 8-element dot product into two accumulators (halves the dependent-FMA chain).
__device__ __forceinline__ void dot8(const uint4& w, const uint4& x, float& a0, float& a1) {
  a0 = fmaf(bf_lo(w.x), bf_lo(x.x), a0); a1 = fmaf(bf_hi(w.x), bf_hi(x.x), a1);
  a0 = fmaf(bf_lo(w.y), bf_lo(x.y), a0); a1 = fmaf(bf_hi(w.y), bf_hi(x.y), a1);
  a0 = fmaf(bf_lo(w.z), bf_lo(x.z), a0); a1 = fmaf(bf_hi(w.z), bf_hi(x.z), a1);
  a0 = fmaf(bf_lo(w.w), bf_lo(x.w), a0); a1 = fmaf(bf_hi(w.w), bf_hi(x.w), a1);
}
__device__ __forceinline__ float warp_sum(float s) {
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
  return s;
}

// ---- mbarrier / bulk-copy PTX (sm_90) ----
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}
__device__ __forceinline__ void mbar_init(uint64_t* bar, uint32_t count) {
  asm volatile("mbarrier.init.shared::cta.b64 [%0], %1;" ::"r"(smem_u32(bar)), "r"(count) : "memory");
}
// One arrival + announce that `bytes` will land on this barrier via complete_tx.
__device__ __forceinline__ void mbar_arrive_expect_tx(uint64_t* bar, uint32_t bytes) {
  asm volatile("mbarrier.arrive.expect_tx.shared::cta.b64 _, [%0], %1;" ::"r"(smem_u32(bar)), "r"(bytes)
               : "memory");
}
__device__ __forceinline__ void mbar_arrive(uint64_t* bar) {  // default .release.cta
  asm volatile("mbarrier.arrive.shared::cta.b64 _, [%0];" ::"r"(smem_u32(bar)) : "memory");
}
__device__ __forceinline__ bool mbar_try_wait(uint64_t* bar, uint32_t parity) {  // default .acquire.cta
  uint32_t ok;
  asm volatile(
      "{\n\t.reg .pred p;\n\t"
      "mbarrier.try_wait.parity.shared::cta.b64 p, [%1], %2;\n\t"
      "selp.u32 %0, 1, 0, p;\n\t}"
      : "=r"(ok)
      : "r"(smem_u32(bar)), "r"(parity)
      : "memory");
  return ok != 0;
}
__device__ __forceinline__ uint64_t global_ns() {
  uint64_t t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return t;
}
// Wait until the phase with parity `parity` has completed. A protocol bug would hang the
// GPU forever, so trap after 2 s: the host then reports a launch failure instead of hanging.
__device__ __forceinline__ void mbar_wait(uint64_t* bar, uint32_t parity) {
  if (mbar_try_wait(bar, parity)) return;
  const uint64_t t0 = global_ns();
  while (!mbar_try_wait(bar, parity))
    if (global_ns() - t0 > 2000000000ull) __trap();
}
// 1-D bulk copy global -> this CTA's shared memory; completion (bytes) is signalled on `bar`.
// A shared::cta address is a valid shared::cluster address naming the executing CTA.
__device__ __forceinline__ void bulk_g2s(void* dst, const void* src, uint32_t bytes, uint64_t* bar) {
  asm volatile(
      "cp.async.bulk.shared::cluster.global.mbarrier::complete_tx::bytes [%0], [%1], %2, [%3];" ::"r"(
          smem_u32(dst)),
      "l"(static_cast<uint64_t>(__cvta_generic_to_global(src))), "r"(bytes), "r"(smem_u32(bar))
      : "memory");
}
__device__ __forceinline__ void named_bar_sync(int id, int nthreads) {
  asm volatile("bar.sync %0, %1;" ::"r"(id), "r"(nthreads) : "memory");
}

// ------------------------------------------------------------------------------------------------
// A / B: warp per row group. R rows per warp, U 16-byte loads per row in flight per lane.
// ------------------------------------------------------------------------------------------------
constexpr int AB_THREADS = 256, AB_WARPS = AB_THREADS / 32;

// XG = false: x staged in shared memory once per block (default, as in all other variants).
// XG = true : x read with __ldg inside the loop (L1-resident), no staging and no __syncthreads, so
//             a short-lived block starts streaming W at once.
template <int R, int U, bool PERSIST, bool PF256, bool XG>
__global__ void __launch_bounds__(AB_THREADS) gemv_warp(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                                        bf16* __restrict__ y, int N, int K) {
  extern __shared__ __align__(16) uint4 xs_smem[];  // x, K/8 vectors (unused when XG)
  const int V = K >> 3;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  if (!XG) {
    for (int i = threadIdx.x; i < V; i += AB_THREADS) xs_smem[i] = __ldg(x4 + i);
    __syncthreads();
  }
  const uint4* xs = XG ? x4 : xs_smem;  // compile-time choice; __ldg below only when XG

  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int groups = (N + R - 1) / R;
  for (int g = blockIdx.x * AB_WARPS + warp; g < groups; g += gridDim.x * AB_WARPS) {
    const uint4* wr[R];
#pragma unroll
    for (int r = 0; r < R; ++r)  // rows past N (partial last group) re-read row N-1, result dropped
      wr[r] = reinterpret_cast<const uint4*>(W) + (size_t)min(g * R + r, N - 1) * V;
    float a0[R], a1[R];
#pragma unroll
    for (int r = 0; r < R; ++r) a0[r] = a1[r] = 0.f;

    int v = lane;
    for (; v + 32 * (U - 1) < V; v += 32 * U) {  // full iterations: U*R loads issued back to back
      uint4 w[R][U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r) w[r][u] = ld_stream<PF256>(wr[r] + v + 32 * u);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        const uint4 xv = XG ? __ldg(xs + v + 32 * u) : xs[v + 32 * u];
#pragma unroll
        for (int r = 0; r < R; ++r) dot8(w[r][u], xv, a0[r], a1[r]);
      }
    }
    if (v < V) {  // tail (< U vectors per lane left): predicated, still all in flight together
      uint4 w[R][U];
#pragma unroll
      for (int u = 0; u < U; ++u)
#pragma unroll
        for (int r = 0; r < R; ++r)
          w[r][u] = (v + 32 * u < V) ? ld_stream<PF256>(wr[r] + v + 32 * u) : make_uint4(0, 0, 0, 0);
#pragma unroll
      for (int u = 0; u < U; ++u) {
        if (v + 32 * u < V) {
          const uint4 xv = XG ? __ldg(xs + v + 32 * u) : xs[v + 32 * u];
#pragma unroll
          for (int r = 0; r < R; ++r) dot8(w[r][u], xv, a0[r], a1[r]);
        }
      }
    }
#pragma unroll
    for (int r = 0; r < R; ++r) {
      const float s = warp_sum(a0[r] + a1[r]);
      if (lane == 0 && g * R + r < N) y[g * R + r] = __float2bfloat16(s);
    }
    if (!PERSIST) break;  // non-persistent grid covers every group exactly once
  }
}

// ------------------------------------------------------------------------------------------------
// E: "A r1 u8 xg" with what a BEM decode kernel adds: each output also gets U[n] . z (rank 8), z written by a
// projection launched just before (one block: z = V^T x). U and V are zeros, so y is still W x and the check
// above holds; their loads and the launches cost what they would. WAIT: launched as a programmatic dependent of
// the projection (griddepcontrol.wait before reading z); EARLY_U: U's row loaded before the row's loop, not after.
// ------------------------------------------------------------------------------------------------
__global__ void __launch_bounds__(256) proj8(const bf16* __restrict__ x, const bf16* __restrict__ Vm,
                                              float* __restrict__ z, int K) {
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
  __shared__ float part[256][8];
  float acc[8] = {0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f, 0.f};
#pragma unroll 4
  for (int k = threadIdx.x; k < K; k += 256) {
    const float xk = __bfloat162float(x[k]);
    const uint4 vv = __ldg(reinterpret_cast<const uint4*>(Vm + (size_t)k * 8));
    const bf16* ve = reinterpret_cast<const bf16*>(&vv);
#pragma unroll
    for (int i = 0; i < 8; ++i) acc[i] = fmaf(xk, __bfloat162float(ve[i]), acc[i]);
  }
#pragma unroll
  for (int i = 0; i < 8; ++i) part[threadIdx.x][i] = acc[i];
  __syncthreads();
  if (threadIdx.x < 8) {
    float sum = 0.f;
    for (int t = 0; t < 256; ++t) sum += part[t][threadIdx.x];
    z[threadIdx.x] = sum;
  }
}

template <bool WAIT, bool EARLY_U>
__global__ void __launch_bounds__(AB_THREADS) gemv_uz(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                                      bf16* __restrict__ y, int N, int K, const bf16* __restrict__ Um,
                                                      const float* __restrict__ z) {
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
  const int n = blockIdx.x * AB_WARPS + warp;
  if (n >= N) return;
  const int V = K >> 3;
  const uint4* wr = reinterpret_cast<const uint4*>(W) + (size_t)n * V;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  float u = 0.f;
  if (EARLY_U && lane < 8) u = __bfloat162float(Um[(size_t)n * 8 + lane]);
  float a0 = 0.f, a1 = 0.f;
  int v = lane;
  for (; v + 32 * 7 < V; v += 32 * 8) {
    uint4 w[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) w[q] = ld_stream<false>(wr + v + 32 * q);
#pragma unroll
    for (int q = 0; q < 8; ++q) dot8(w[q], __ldg(x4 + v + 32 * q), a0, a1);
  }
  if (v < V) {
    uint4 w[8];
#pragma unroll
    for (int q = 0; q < 8; ++q) w[q] = (v + 32 * q < V) ? ld_stream<false>(wr + v + 32 * q) : make_uint4(0, 0, 0, 0);
#pragma unroll
    for (int q = 0; q < 8; ++q)
      if (v + 32 * q < V) dot8(w[q], __ldg(x4 + v + 32 * q), a0, a1);
  }
  if (!EARLY_U && lane < 8) u = __bfloat162float(Um[(size_t)n * 8 + lane]);
  if (WAIT) asm volatile("griddepcontrol.wait;" ::: "memory");
  float sum = a0 + a1 + (lane < 8 ? u * z[lane] : 0.f);
  sum = warp_sum(sum);
  if (lane == 0) y[n] = __float2bfloat16(sum);
}

// ------------------------------------------------------------------------------------------------
// C / D: bulk-copy ring. Block = CW consumer warps + 1 producer warp (lane 0 issues the copies).
// A "chunk" = RPC whole consecutive rows (contiguous RPC*K*2 bytes, a multiple of 16); chunk c holds
// rows [c*RPC, min(N, (c+1)*RPC)). Block b takes chunks b, b+G, b+2G... (round robin, contig=0) or a
// contiguous range (contig=1). Shared memory: [barriers 256 B][STAGES stages][x][per-block y sums].
// ------------------------------------------------------------------------------------------------
constexpr int CW = 8;                        // consumer warps
constexpr int BULK_THREADS = (CW + 1) * 32;  // + producer warp
constexpr int BAR_BYTES = 256;

template <int STAGES>
__global__ void __launch_bounds__(BULK_THREADS, 1) gemv_bulk(const bf16* __restrict__ W, const bf16* __restrict__ x,
                                                             bf16* __restrict__ y, int N, int K, int RPC, int contig) {
  static_assert(2 * STAGES * 8 <= BAR_BYTES, "barrier area too small");
  extern __shared__ __align__(128) unsigned char smem[];
  uint64_t* full = reinterpret_cast<uint64_t*>(smem);  // "stage s holds data"   (count 1 + tx bytes)
  uint64_t* empty = full + STAGES;                      // "stage s may be reused" (count CW)
  const int V = K >> 3;                                 // 16-byte vectors per row
  const size_t row_bytes = (size_t)K * 2;
  const size_t stage_bytes = (size_t)RPC * row_bytes;
  unsigned char* stages = smem + BAR_BYTES;
  uint4* xs = reinterpret_cast<uint4*>(stages + STAGES * stage_bytes);
  float* ysum = reinterpret_cast<float*>(xs + V);

  // This block's chunk list (host sizes ysum with the same formula: ceil(NC/G)*RPC floats).
  const int NC = (N + RPC - 1) / RPC, G = gridDim.x, b = blockIdx.x;
  int first, step, count;
  if (contig) {
    const int lo = (int)((long long)b * NC / G), hi = (int)((long long)(b + 1) * NC / G);
    first = lo; step = 1; count = hi - lo;
  } else {
    first = b; step = G; count = (b < NC) ? (NC - 1 - b) / G + 1 : 0;
  }
  const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;

  if (threadIdx.x == CW * 32) {  // producer thread initialises the barriers
    for (int s = 0; s < STAGES; ++s) { mbar_init(&full[s], 1); mbar_init(&empty[s], CW); }
    // make the inits visible to the other threads and to the async (bulk-copy) proxy
    asm volatile("fence.mbarrier_init.release.cluster;" ::: "memory");
    asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
  }
  __syncthreads();  // the only block-wide barrier; after it the producer warp never syncs again

  if (warp == CW) {
    // ---------------- producer ----------------
    if (lane == 0) {
      for (int it = 0; it < count; ++it) {
        const int s = it % STAGES;
        // use u = it/STAGES of stage s needs release u-1, i.e. empty phase u-1 done: parity ((u&1)^1).
        // For u == 0 parity 1 refers to the (virtual) phase before phase 0 and returns at once.
        mbar_wait(&empty[s], ((it / STAGES) & 1) ^ 1);
        const int r0 = (first + it * step) * RPC;
        const uint32_t bytes = (uint32_t)(min(RPC, N - r0) * row_bytes);  // partial last chunk
        mbar_arrive_expect_tx(&full[s], bytes);
        bulk_g2s(stages + s * stage_bytes, W + (size_t)r0 * K, bytes, &full[s]);
      }
      // Tail: wait until consumers released the last STAGES uses, so every issued copy has landed
      // and been consumed before this thread exits (belt and braces; no other CTA is involved).
      for (int it = count; it < count + STAGES; ++it) mbar_wait(&empty[it % STAGES], ((it / STAGES) & 1) ^ 1);
    }
    return;
  }

  // ---------------- consumers (CW warps) ----------------
  const int ctid = threadIdx.x, nct = CW * 32;
  const uint4* x4 = reinterpret_cast<const uint4*>(x);
  for (int i = ctid; i < V; i += nct) xs[i] = __ldg(x4 + i);  // overlaps the first bulk copies
  for (int i = ctid; i < count * RPC; i += nct) ysum[i] = 0.f;
  named_bar_sync(1, nct);

  for (int it = 0; it < count; ++it) {
    const int s = it % STAGES;
    mbar_wait(&full[s], (it / STAGES) & 1);
    const int r0 = (first + it * step) * RPC;
    const int rows = min(RPC, N - r0);
    const uint4* ws = reinterpret_cast<const uint4*>(stages + s * stage_bytes);
    // Split the chunk's rows*V vectors into CW contiguous ranges (multiples of 32), one per warp.
    const int T = rows * V;
    const int per = (((T + CW - 1) / CW) + 31) & ~31;
    const int end = min(T, (warp + 1) * per);
    for (int i = warp * per; i < end;) {  // one segment per row touched by this warp's range
      const int row = i / V;
      const int seg_end = min(end, (row + 1) * V);
      const uint4* wrow = ws + (size_t)row * V;
      float a0 = 0.f, a1 = 0.f;
#pragma unroll 4
      for (int j = i + lane; j < seg_end; j += 32) dot8(wrow[j - row * V], xs[j - row * V], a0, a1);
      const float sum = warp_sum(a0 + a1);
      if (lane == 0) atomicAdd(&ysum[it * RPC + row], sum);  // a row may be split across warps
      i = seg_end;
    }
    __syncwarp();  // all lanes' shared reads of stage s are done ...
    if (lane == 0) mbar_arrive(&empty[s]);  // ... before one release-arrive per warp
  }
  named_bar_sync(1, nct);  // all partial sums added
  for (int l = ctid; l < count * RPC; l += nct) {
    const int it = l / RPC;
    const int row = (first + it * step) * RPC + (l - it * RPC);
    if (row < N) y[row] = __float2bfloat16(ysum[l]);
  }
}
