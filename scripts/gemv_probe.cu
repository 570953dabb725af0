// gemv_probe.cu -- which memory-access design of a plain bf16 GEMV (y = W x, one token)
// reaches cuBLAS's time on H100/H200 (sm_90a)?
//
//   W: N x K row-major bf16, x: K bf16, y: N bf16, fp32 accumulation.
//
// Build: nvcc -std=c++17 -O3 -arch=sm_90a -lcublas -o gemv_probe gemv_probe.cu  (on the device, with the
//        cuBLAS headers and library of the nvidia-cublas wheel torch brings: -I .../nvidia/cu13/include, -L .../lib)
// Run:   ./gemv_probe [--shapes KxN,KxN,...] [--rounds 3] [--reps 50] [--warmup 20] [--only SUB1,SUB2]
//
// Variants (all compute the same y; the kernels are in gemv_probe_kernels.cuh):
//   A  warp-per-row-group, non-persistent: 256 threads, warp = R rows, U 16-byte nc loads per row in flight
//   B  same inner loop, persistent grid (SMs x occupancy), grid-stride over row groups
//   C  one block per SM, 1 producer thread issuing 1-D bulk copies (cp.async.bulk) of whole rows into a
//      STAGES-deep shared-memory ring with full/empty mbarriers, 8 consumer warps
//   D  = C launched as thread-block clusters of 2 (each block still owns its own rows)
//   E  = "A r1 u8 xg" plus what a BEM decode kernel adds: U[n] . z at rank 8 (U's row loaded before or after the
//      row's loop), z from a one-block projection launched before it, in stream order or as its programmatic
//      dependent launch (griddepcontrol.wait before reading z)
// x is staged in shared memory once per block in every variant, except the two extra "xg" variants of A,
// which read x with __ldg in the inner loop (to see whether the staging barrier delays short-lived blocks).
// "pf" variants add the .L2::256B prefetch-size hint to the W loads.
#include <cuda_runtime.h>
#include <cuda_bf16.h>
#include <cublas_v2.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <string>
#include <vector>

static std::string g_where = "startup";  // what was running when an error hit (printed by the macros)
#define CK(call)                                                                                  \
  do {                                                                                            \
    cudaError_t e_ = (call);                                                                      \
    if (e_ != cudaSuccess) {                                                                      \
      fprintf(stderr, "CUDA error '%s' in %s (%s:%d) while: %s\n", cudaGetErrorString(e_), #call, \
              __FILE__, __LINE__, g_where.c_str());                                               \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)
#define CB(call)                                                                                  \
  do {                                                                                            \
    cublasStatus_t s_ = (call);                                                                   \
    if (s_ != CUBLAS_STATUS_SUCCESS) {                                                            \
      fprintf(stderr, "cuBLAS error %d in %s (%s:%d) while: %s\n", (int)s_, #call, __FILE__,      \
              __LINE__, g_where.c_str());                                                         \
      exit(1);                                                                                    \
    }                                                                                             \
  } while (0)

#include "gemv_probe_kernels.cuh"

// ------------------------------------------------------------------------------------------------
// Deterministic init: splitmix64 hash -> uniform [-1, 1) -> bf16
// ------------------------------------------------------------------------------------------------
__host__ __device__ inline uint64_t mix64(uint64_t z) {
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}
__global__ void fill_uniform(bf16* p, size_t n, uint64_t seed) {
  for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
    const uint32_t h = (uint32_t)(mix64(i + seed * 0x9E3779B97F4A7C15ull) >> 40);  // 24 bits
    p[i] = __float2bfloat16((float)h * (2.0f / 16777216.0f) - 1.0f);
  }
}
static float bf16_bits_to_float(uint16_t b) {
  uint32_t u = (uint32_t)b << 16;
  float f;
  memcpy(&f, &u, 4);
  return f;
}

// ------------------------------------------------------------------------------------------------
// Host side
// ------------------------------------------------------------------------------------------------
struct Dev {
  int sms;
  size_t smem_optin, smem_per_sm;
};
struct Variant {
  std::string name;
  bool ok = true;          // runnable for this shape (else "n/a")
  std::string info;        // launch shape, printed once per shape
  std::function<void(const bf16* W, cudaStream_t st)> launch;
};

template <int R, int U, bool P, bool PF, bool XG = false>
static Variant make_warp(const std::string& name, const Dev& d, int N, int K, const bf16* x, bf16* y) {
  Variant v;
  v.name = name;
  auto kern = gemv_warp<R, U, P, PF, XG>;
  const size_t smem = (size_t)K * 2 * (XG ? 0 : 1);  // x staging buffer (none when XG)
  if (smem > d.smem_optin) { v.ok = false; return v; }
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)smem));
  const int groups = (N + R - 1) / R, need = (groups + AB_WARPS - 1) / AB_WARPS;
  int grid = need, per_sm = 0;
  if (P) {
    CK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kern, AB_THREADS, smem));
    grid = std::min(need, d.sms * std::max(per_sm, 1));
  }
  char buf[128];
  snprintf(buf, sizeof buf, "grid %d x %d thr%s", grid, AB_THREADS,
           P ? (" (" + std::to_string(per_sm) + "/SM)").c_str() : "");
  v.info = buf;
  v.launch = [=](const bf16* W, cudaStream_t st) {
    kern<<<grid, AB_THREADS, smem, st>>>(W, x, y, N, K);
    CK(cudaGetLastError());
  };
  return v;
}

// E variants. proj: launch the projection first (else z is read as it is); pdl: the GEMV as its programmatic
// dependent (else in stream order).
template <bool EARLY_U>
static Variant make_uz(const std::string& name, bool proj, bool pdl, int N, int K, const bf16* x, bf16* y,
                       const bf16* Um, const bf16* Vm, float* z) {
  Variant v;
  v.name = name;
  const int grid = (N + AB_WARPS - 1) / AB_WARPS;
  v.info = "grid " + std::to_string(grid) + " x " + std::to_string(AB_THREADS) + " thr" +
           (proj ? (pdl ? ", after a 1-block projection (PDL)" : ", after a 1-block projection") : ", z ready");
  v.launch = [=](const bf16* W, cudaStream_t st) {
    if (proj) {
      proj8<<<1, 256, 0, st>>>(x, Vm, z, K);
      CK(cudaGetLastError());
    }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(grid);
    cfg.blockDim = dim3(AB_THREADS);
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
    at[0].val.programmaticStreamSerializationAllowed = 1;
    cfg.attrs = at;
    cfg.numAttrs = proj && pdl ? 1 : 0;
    if (proj && pdl)
      CK(cudaLaunchKernelEx(&cfg, gemv_uz<true, EARLY_U>, W, x, y, N, K, Um, (const float*)z));
    else
      CK(cudaLaunchKernelEx(&cfg, gemv_uz<false, EARLY_U>, W, x, y, N, K, Um, (const float*)z));
  };
  return v;
}

using BulkFn = void (*)(const bf16*, const bf16*, bf16*, int, int, int, int);
static BulkFn bulk_kernel(int stages) {
  switch (stages) {
    case 4: return gemv_bulk<4>;
    case 6: return gemv_bulk<6>;
    case 8: return gemv_bulk<8>;
    case 12: return gemv_bulk<12>;
  }
  return nullptr;
}

// cluster: 1 or 2. dgrid: use the clustered variant's grid size without clustering (isolates grid size).
static Variant make_bulk(const std::string& name, int stages, int chunk_bytes, int cluster, int contig, bool dgrid,
                         const Dev& d, int N, int K, const bf16* x, bf16* y) {
  Variant v;
  v.name = name;
  BulkFn kern = bulk_kernel(stages);
  const size_t row_bytes = (size_t)K * 2;
  const int RPC = (int)std::max<size_t>(1, chunk_bytes / row_bytes);  // whole rows per chunk
  const size_t stage_bytes = RPC * row_bytes;
  const int NC = (N + RPC - 1) / RPC;
  // Dynamic smem for a grid of G blocks. Padded above half an SM's shared memory so that at
  // most one block can be resident per SM (the design: one block per SM, like cuBLAS).
  auto smem_for = [&](int G) {
    const int maxc = (NC + G - 1) / G;
    size_t s = BAR_BYTES + (size_t)stages * stage_bytes + row_bytes + (size_t)maxc * RPC * 4;
    s = (s + 15) & ~(size_t)15;
    return std::max(s, d.smem_per_sm / 2 + 1024);
  };
  CK(cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)d.smem_optin));
  int G = std::min(d.sms, NC);
  int nclusters = 0;
  if (cluster > 1 || dgrid) {
    if (smem_for(G) > d.smem_optin) { v.ok = false; return v; }
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(2);
    cfg.blockDim = dim3(BULK_THREADS);
    cfg.dynamicSmemBytes = smem_for(G);
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = 2; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = 1;
    CK(cudaOccupancyMaxActiveClusters(&nclusters, kern, &cfg));
    if (nclusters < 1) { v.ok = false; return v; }
    G = std::min((NC + 1) & ~1, 2 * nclusters);  // even; blocks past NC simply get no chunks
  }
  const size_t smem = smem_for(G);
  if (smem > d.smem_optin) { v.ok = false; return v; }
  char buf[160];
  snprintf(buf, sizeof buf, "grid %d x %d thr, %d rows/chunk (%zu B), smem %zu B%s", G, BULK_THREADS, RPC,
           stage_bytes, smem, cluster > 1 ? ", cluster 2" : "");
  v.info = buf;
  const int cl = cluster;
  v.launch = [=](const bf16* W, cudaStream_t st) {
    cudaLaunchConfig_t cfg = {};
    cfg.gridDim = dim3(G);
    cfg.blockDim = dim3(BULK_THREADS);
    cfg.dynamicSmemBytes = smem;
    cfg.stream = st;
    cudaLaunchAttribute at[1];
    at[0].id = cudaLaunchAttributeClusterDimension;
    at[0].val.clusterDim.x = cl; at[0].val.clusterDim.y = 1; at[0].val.clusterDim.z = 1;
    cfg.attrs = at;
    cfg.numAttrs = cl > 1 ? 1 : 0;
    CK(cudaLaunchKernelEx(&cfg, kern, W, x, y, N, K, RPC, contig));
  };
  return v;
}

static double median(std::vector<double> v) {
  std::sort(v.begin(), v.end());
  const size_t n = v.size();
  return n % 2 ? v[n / 2] : 0.5 * (v[n / 2 - 1] + v[n / 2]);
}

struct Result {
  std::vector<double> us;   // per variant (index 0 = cuBLAS); NaN = n/a
  std::vector<bool> fail;   // per variant
  std::vector<double> err;  // max relative error
};

int main(int argc, char** argv) {
  std::vector<std::pair<int, int>> shapes = {{2048, 8192}, {8192, 2048}, {4096, 4096},
                                             {1536, 8960}, {3072, 16384}, {576, 1536}};
  int rounds = 3, reps = 50, warmup = 20;
  std::vector<std::string> only;
  for (int i = 1; i < argc; ++i) {
    std::string a = argv[i];
    auto next = [&]() -> std::string {
      if (i + 1 >= argc) { fprintf(stderr, "missing value after %s\n", a.c_str()); exit(2); }
      return argv[++i];
    };
    auto split = [](const std::string& s) {
      std::vector<std::string> out;
      size_t p = 0;
      while (p <= s.size()) {
        size_t q = s.find(',', p);
        if (q == std::string::npos) q = s.size();
        if (q > p) out.push_back(s.substr(p, q - p));
        p = q + 1;
      }
      return out;
    };
    if (a == "--shapes") {
      shapes.clear();
      for (auto& t : split(next())) {
        int k = 0, n = 0;
        if (sscanf(t.c_str(), "%dx%d", &k, &n) != 2 || k <= 0 || n <= 0 || k % 8) {
          fprintf(stderr, "bad shape '%s' (want KxN with K a multiple of 8)\n", t.c_str());
          return 2;
        }
        shapes.push_back({k, n});
      }
    } else if (a == "--rounds") rounds = std::max(1, atoi(next().c_str()));
    else if (a == "--reps") reps = std::max(1, atoi(next().c_str()));
    else if (a == "--warmup") warmup = std::max(0, atoi(next().c_str()));
    else if (a == "--only") only = split(next());
    else {
      printf("usage: %s [--shapes KxN,...] [--rounds R] [--reps N] [--warmup N] [--only SUB,...]\n"
             "  shapes are K x N (W is N rows of K bf16); --only keeps variants whose name contains a SUB\n",
             argv[0]);
      return a == "--help" || a == "-h" ? 0 : 2;
    }
  }

  // ---- device info ----
  int dev = 0;
  CK(cudaSetDevice(dev));
  cudaDeviceProp prop;
  CK(cudaGetDeviceProperties(&prop, dev));
  int memclk_khz = 0, bus_bits = 0;
  CK(cudaDeviceGetAttribute(&memclk_khz, cudaDevAttrMemoryClockRate, dev));
  CK(cudaDeviceGetAttribute(&bus_bits, cudaDevAttrGlobalMemoryBusWidth, dev));
  const double peak_gbs = 2.0 * memclk_khz * 1e3 * (bus_bits / 8.0) / 1e9;  // DDR: 2 transfers / clock
  Dev d{prop.multiProcessorCount, prop.sharedMemPerBlockOptin, prop.sharedMemPerMultiprocessor};
  printf("Device: %s | SMs %d | memory clock %.0f MHz | bus %d bit | theoretical DRAM BW %.0f GB/s | L2 %.0f MB\n",
         prop.name, d.sms, memclk_khz / 1e3, bus_bits, peak_gbs, prop.l2CacheSize / 1e6);
  if (prop.major != 9) printf("WARNING: built for sm_90a, device is sm_%d%d\n", prop.major, prop.minor);

  cudaStream_t st;
  CK(cudaStreamCreateWithFlags(&st, cudaStreamNonBlocking));
  cublasHandle_t handle;
  CB(cublasCreate(&handle));
  const size_t ws_bytes = 32u << 20;  // fixed workspace: cuBLAS must not allocate during capture
  void* ws = nullptr;
  CK(cudaMalloc(&ws, ws_bytes));
  CB(cublasSetWorkspace(handle, ws, ws_bytes));
  CB(cublasSetStream(handle, st));
  std::vector<cudaEvent_t> ev(reps + 1);
  for (auto& e : ev) CK(cudaEventCreate(&e));

  std::vector<std::string> names;  // column names (filled on the first shape)
  std::vector<Result> results;

  for (const auto& shp : shapes) {
    const int K = shp.first, N = shp.second;  // plain ints: lambdas below capture them (C++17)
    char sh[64];
    snprintf(sh, sizeof sh, "%dx%d", K, N);
    const size_t NK = (size_t)N * K, wbytes = NK * 2;
    // Copies: total >= 3 x 50 MB so successive calls rotate past L2. Calls per graph: a multiple of
    // the copy count and >= 8, so the rotation is seamless across back-to-back graph replays.
    const int copies = (int)std::max<size_t>(2, (150000000ull + wbytes - 1) / wbytes);
    const int calls = copies * ((8 + copies - 1) / copies);
    g_where = std::string("allocating/initialising shape ") + sh;
    bf16 *Wall, *x, *y;
    CK(cudaMalloc(&Wall, wbytes * copies));
    CK(cudaMalloc(&x, (size_t)K * 2));
    CK(cudaMalloc(&y, (size_t)N * 2));
    bf16 *Um, *Vm;  // the E variants' rank-8 U (N x 8) and V (K x 8): zeros, so y stays W x
    float* z;
    CK(cudaMalloc(&Um, (size_t)N * 8 * 2));
    CK(cudaMalloc(&Vm, (size_t)K * 8 * 2));
    CK(cudaMalloc(&z, 8 * sizeof(float)));
    CK(cudaMemset(Um, 0, (size_t)N * 8 * 2));
    CK(cudaMemset(Vm, 0, (size_t)K * 8 * 2));
    CK(cudaMemset(z, 0, 8 * sizeof(float)));
    for (int c = 0; c < copies; ++c) {
      fill_uniform<<<1024, 256, 0, st>>>(Wall + c * NK, NK, 1000 + c);
      CK(cudaGetLastError());
    }
    fill_uniform<<<64, 256, 0, st>>>(x, K, 7);
    CK(cudaGetLastError());
    CK(cudaStreamSynchronize(st));

    // Host fp64 reference for copy 0, all rows.
    std::vector<uint16_t> hW(NK), hx(K), hy(N);
    CK(cudaMemcpy(hW.data(), Wall, wbytes, cudaMemcpyDeviceToHost));
    CK(cudaMemcpy(hx.data(), x, (size_t)K * 2, cudaMemcpyDeviceToHost));
    std::vector<double> xf(K), ref(N);
    for (int k = 0; k < K; ++k) xf[k] = bf16_bits_to_float(hx[k]);
    double maxref = 0;
    for (int n = 0; n < N; ++n) {
      double s = 0;
      const uint16_t* row = hW.data() + (size_t)n * K;
      for (int k = 0; k < K; ++k) s += (double)bf16_bits_to_float(row[k]) * xf[k];
      ref[n] = s;
      maxref = std::max(maxref, std::fabs(s));
    }
    maxref = std::max(maxref, 1e-30);

    // ---- variants ----
    std::vector<Variant> vs;
    {
      Variant cb;
      cb.name = "cuBLAS";
      cb.info = "cublasGemmEx(T,N, m=N n=1 k=K, bf16 in/out, COMPUTE_32F)";
      cb.launch = [=](const bf16* W, cudaStream_t) {
        const float alpha = 1.f, beta = 0.f;
        // W row-major N x K == column-major K x N (lda=K); y = op(A)^T x with op = T.
        CB(cublasGemmEx(handle, CUBLAS_OP_T, CUBLAS_OP_N, N, 1, K, &alpha, W, CUDA_R_16BF, K, x, CUDA_R_16BF, K,
                        &beta, y, CUDA_R_16BF, N, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
      };
      vs.push_back(cb);
    }
    vs.push_back(make_warp<1, 4, false, false>("A r1 u4", d, N, K, x, y));
    vs.push_back(make_warp<1, 8, false, false>("A r1 u8", d, N, K, x, y));
    vs.push_back(make_warp<2, 4, false, false>("A r2 u4", d, N, K, x, y));
    vs.push_back(make_warp<2, 8, false, false>("A r2 u8", d, N, K, x, y));
    vs.push_back(make_warp<4, 4, false, false>("A r4 u4", d, N, K, x, y));
    vs.push_back(make_warp<4, 8, false, false>("A r4 u8", d, N, K, x, y));
    vs.push_back(make_warp<2, 8, false, true>("A r2 u8 pf", d, N, K, x, y));
    vs.push_back(make_warp<1, 8, false, false, true>("A r1 u8 xg", d, N, K, x, y));
    vs.push_back(make_warp<2, 8, false, false, true>("A r2 u8 xg", d, N, K, x, y));
    vs.push_back(make_warp<1, 4, true, false>("B r1 u4", d, N, K, x, y));
    vs.push_back(make_warp<1, 8, true, false>("B r1 u8", d, N, K, x, y));
    vs.push_back(make_warp<2, 4, true, false>("B r2 u4", d, N, K, x, y));
    vs.push_back(make_warp<2, 8, true, false>("B r2 u8", d, N, K, x, y));
    vs.push_back(make_warp<4, 4, true, false>("B r4 u4", d, N, K, x, y));
    vs.push_back(make_warp<4, 8, true, false>("B r4 u8", d, N, K, x, y));
    vs.push_back(make_warp<2, 8, true, true>("B r2 u8 pf", d, N, K, x, y));
    vs.push_back(make_uz<true>("E uz", false, false, N, K, x, y, Um, Vm, z));
    vs.push_back(make_uz<false>("E uz lateU", false, false, N, K, x, y, Um, Vm, z));
    vs.push_back(make_uz<true>("E proj seq", true, false, N, K, x, y, Um, Vm, z));
    vs.push_back(make_uz<true>("E proj pdl", true, true, N, K, x, y, Um, Vm, z));
    vs.push_back(make_uz<false>("E proj pdl lateU", true, true, N, K, x, y, Um, Vm, z));
    const int KB = 1024;
    //                      name            stages chunk  cluster contig dgrid
    vs.push_back(make_bulk("C s4 16K", 4, 16 * KB, 1, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s8 16K", 8, 16 * KB, 1, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s12 16K", 12, 16 * KB, 1, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s4 32K", 4, 32 * KB, 1, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s6 32K", 6, 32 * KB, 1, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s8 16K ctg", 8, 16 * KB, 1, 1, false, d, N, K, x, y));
    vs.push_back(make_bulk("C s8 16K gD", 8, 16 * KB, 1, 0, true, d, N, K, x, y));
    vs.push_back(make_bulk("D s4 16K", 4, 16 * KB, 2, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("D s8 16K", 8, 16 * KB, 2, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("D s12 16K", 12, 16 * KB, 2, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("D s4 32K", 4, 32 * KB, 2, 0, false, d, N, K, x, y));
    vs.push_back(make_bulk("D s6 32K", 6, 32 * KB, 2, 0, false, d, N, K, x, y));
    if (!only.empty()) {
      std::vector<Variant> keep{vs[0]};
      for (size_t i = 1; i < vs.size(); ++i)
        for (auto& s : only)
          if (vs[i].name.find(s) != std::string::npos) { keep.push_back(vs[i]); break; }
      vs.swap(keep);
    }
    const size_t nv = vs.size();
    if (names.empty())
      for (auto& v : vs) names.push_back(v.name);

    printf("\n[%s] K=%d N=%d: %.1f MB/matrix, %d copies (%.0f MB), %d calls per graph\n", sh, K, N, wbytes / 1e6,
           copies, copies * wbytes / 1e6, calls);
    for (auto& v : vs) printf("  %-13s %s\n", v.name.c_str(), v.ok ? v.info.c_str() : "n/a (does not fit)");

    // ---- correctness on copy 0, y poisoned with NaN (0xFFFF) first ----
    Result res;
    res.us.assign(nv, NAN);
    res.fail.assign(nv, false);
    res.err.assign(nv, NAN);
    for (size_t i = 0; i < nv; ++i) {
      if (!vs[i].ok) continue;
      g_where = "correctness run of " + vs[i].name + " on " + sh;
      CK(cudaMemsetAsync(y, 0xFF, (size_t)N * 2, st));
      vs[i].launch(Wall, st);  // for cuBLAS this is also the required uncaptured first call
      CK(cudaStreamSynchronize(st));
      CK(cudaMemcpy(hy.data(), y, (size_t)N * 2, cudaMemcpyDeviceToHost));
      double e = 0;
      bool bad = false;
      for (int n = 0; n < N; ++n) {
        const double r = std::fabs((double)bf16_bits_to_float(hy[n]) - ref[n]) / maxref;
        if (!(r < 2e-2)) bad = true;  // also catches NaN (unwritten output)
        e = std::isnan(r) ? INFINITY : std::max(e, r);
      }
      res.err[i] = e;
      res.fail[i] = bad;
      if (bad) printf("  FAIL %s: max rel err %.3g\n", vs[i].name.c_str(), e);
    }

    // ---- graphs: `calls` consecutive calls, call c uses copy c % copies ----
    std::vector<cudaGraphExec_t> gx(nv, nullptr);
    for (size_t i = 0; i < nv; ++i) {
      if (!vs[i].ok) continue;
      g_where = "capturing " + vs[i].name + " on " + sh;
      cudaGraph_t g;
      CK(cudaStreamBeginCapture(st, cudaStreamCaptureModeGlobal));
      for (int c = 0; c < calls; ++c) vs[i].launch(Wall + (size_t)(c % copies) * NK, st);
      CK(cudaStreamEndCapture(st, &g));
      CK(cudaGraphInstantiate(&gx[i], g, 0));
      CK(cudaGraphDestroy(g));
    }

    // ---- timing: round robin over variants; per round median of `reps` replays ----
    std::vector<std::vector<double>> round_med(nv);
    for (int r = 0; r < rounds; ++r) {
      for (size_t i = 0; i < nv; ++i) {
        if (!gx[i]) continue;
        g_where = "timing " + vs[i].name + " on " + sh;
        for (int w = 0; w < warmup; ++w) CK(cudaGraphLaunch(gx[i], st));
        CK(cudaEventRecord(ev[0], st));
        for (int k = 0; k < reps; ++k) {  // back-to-back replays, one event between each
          CK(cudaGraphLaunch(gx[i], st));
          CK(cudaEventRecord(ev[k + 1], st));
        }
        CK(cudaEventSynchronize(ev[reps]));
        std::vector<double> t(reps);
        for (int k = 0; k < reps; ++k) {
          float ms;
          CK(cudaEventElapsedTime(&ms, ev[k], ev[k + 1]));
          t[k] = ms * 1e3 / calls;
        }
        round_med[i].push_back(median(t));
      }
    }
    for (size_t i = 0; i < nv; ++i)
      if (gx[i]) {
        res.us[i] = median(round_med[i]);
        CK(cudaGraphExecDestroy(gx[i]));
      }
    results.push_back(res);
    CK(cudaFree(Wall));
    CK(cudaFree(x));
    CK(cudaFree(y));
    CK(cudaFree(Um));
    CK(cudaFree(Vm));
    CK(cudaFree(z));
  }
  g_where = "printing";

  // ---- table: rows = shapes ----
  const size_t nv = names.size();
  auto cell = [&](const Result& r, size_t i) -> std::string {
    char b[64];
    if (std::isnan(r.us[i])) return "n/a";
    if (r.fail[i]) { snprintf(b, sizeof b, "FAIL %.1f", r.us[i]); return b; }
    if (i == 0) { snprintf(b, sizeof b, "%.2f", r.us[i]); return b; }
    snprintf(b, sizeof b, "%.2f (%.2fx)", r.us[i], r.us[i] / r.us[0]);
    return b;
  };
  auto best_of = [&](const Result& r) {
    int bi = -1;
    for (size_t i = 1; i < nv; ++i)
      if (!std::isnan(r.us[i]) && !r.fail[i] && (bi < 0 || r.us[i] < r.us[bi])) bi = (int)i;
    return bi;
  };
  std::vector<std::string> shape_names;
  for (auto [K, N] : shapes) shape_names.push_back(std::to_string(K) + "x" + std::to_string(N));

  printf("\nPer-call time in us (graph of back-to-back calls, L2-cold weights; median of %d rounds x %d "
         "replays).\n(ratio) = variant time / cuBLAS time: < 1 is faster than cuBLAS. Shapes are KxN.\n\n",
         rounds, reps);
  std::vector<size_t> w(nv + 2);
  w[0] = 11;
  for (size_t i = 0; i < nv; ++i) {
    w[i + 1] = std::max<size_t>(names[i].size(), i == 0 ? 8 : 14);
    for (auto& r : results) w[i + 1] = std::max(w[i + 1], cell(r, i).size());
  }
  w[nv + 1] = 24;
  printf("%-*s", (int)w[0], "shape");
  for (size_t i = 0; i < nv; ++i) printf(" | %*s", (int)w[i + 1], i == 0 ? "cuBLAS us" : names[i].c_str());
  printf(" | %s\n", "best variant");
  for (size_t s = 0; s < results.size(); ++s) {
    printf("%-*s", (int)w[0], shape_names[s].c_str());
    for (size_t i = 0; i < nv; ++i) printf(" | %*s", (int)w[i + 1], cell(results[s], i).c_str());
    const int bi = best_of(results[s]);
    if (bi >= 0) printf(" | %s %s\n", names[bi].c_str(), cell(results[s], bi).c_str());
    else printf(" | -\n");
  }

  // ---- same numbers transposed (easier to read in a terminal) ----
  printf("\nSame table transposed (rows = variants):\n%-13s", "variant");
  for (auto& s : shape_names) printf(" | %15s", s.c_str());
  printf("\n");
  for (size_t i = 0; i < nv; ++i) {
    printf("%-13s", names[i].c_str());
    for (auto& r : results) printf(" | %15s", cell(r, i).c_str());
    printf("\n");
  }

  // ---- achieved bandwidth ----
  printf("\nAchieved bandwidth, bytes = N*K*2 + K*2 + N*2 (peak %.0f GB/s):\n", peak_gbs);
  for (size_t s = 0; s < results.size(); ++s) {
    const auto [K, N] = shapes[s];
    const double bytes = (double)N * K * 2 + K * 2.0 + N * 2.0;
    const Result& r = results[s];
    printf("  %-11s cuBLAS %7.2f us %6.0f GB/s (%4.1f%%)", shape_names[s].c_str(), r.us[0], bytes / r.us[0] / 1e3,
           100.0 * bytes / r.us[0] / 1e3 / peak_gbs);
    const int bi = best_of(r);
    if (bi >= 0)
      printf(" | best %-13s %7.2f us %6.0f GB/s (%4.1f%%)", names[bi].c_str(), r.us[bi], bytes / r.us[bi] / 1e3,
             100.0 * bytes / r.us[bi] / 1e3 / peak_gbs);
    printf("\n");
  }
  int nfail = 0;
  double worst = 0;
  for (auto& r : results)
    for (size_t i = 0; i < nv; ++i) {
      nfail += r.fail[i] ? 1 : 0;
      if (!r.fail[i] && !std::isnan(r.err[i])) worst = std::max(worst, r.err[i]);
    }
  printf("\nCorrectness vs fp64 host reference (copy 0, all rows, tol 2e-2 of max|ref|): %d FAIL, worst passing "
         "max rel err %.2e\n",
         nfail, worst);

  for (auto& e : ev) CK(cudaEventDestroy(e));
  CB(cublasDestroy(handle));
  CK(cudaFree(ws));
  CK(cudaStreamDestroy(st));
  return nfail ? 1 : 0;
}
