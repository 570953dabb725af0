// Y = X W^T + b + s ((X V) ⊙ codes) U^T as one Hopper GEMM with the update inside (fp16/bf16, sm_90a).
// Also the backward's dX = dY W + (s (dY U) ⊙ codes) V^T: the same GEMM given the scaled projection, with
// the weight read transposed (W^T's tiles are N-major); and either form for GPT-2's Conv1D weights.
//
// Where K x N is small (768 x 768: about 35 us for cuBLAS at M = 16384 on an H200) a separate update
// pass costs more than half of the GEMM, most of it in reading and writing Y a second time; at a few
// hundred rows any separate update pass is a chain of latencies of its own. Here each 128 x 256 (or
// 128 x 128) tile of Y accumulates X W^T over K on the warpgroup tensor cores (wgmma, operands brought
// into shared memory by TMA); the same X tiles also multiply V^T, so P = X V for the tile's rows comes
// out of the loop too (V^T's rows ride along with W's last 128 in one wider wgmma). After the loop the
// tile adds (s P ⊙ codes) U^T, with P ⊙ codes as register operands, and writes Y once. P is recomputed
// by each of a row's column tiles: r / 256 (or r / 128) more work per step, cheap while r and N are
// small.
//
// The copies run ahead of the tensor cores by up to 4 stages (3 at r > 32; with 128 columns 6 and 5):
// the producer waits for a stage's "empty" barrier and starts its TMA copies, which signal its "full"
// barrier when they land; the consumers wait for "full", run the stage's wgmma and release the stage
// once they are done.
// X, W, V^T and U tiles come in as K-major rows of 128 bytes with the 128-byte swizzle, the layout
// wgmma reads without bank conflicts; TMA fills rows and columns past the tensors with zeros (U's tile
// is 64 columns wide whatever r is). A transposed weight (WT: W given as a row-major K x N tensor, GPT-2's
// Conv1D layout or the backward's W) comes in as BN / 64 boxes of 64 k-rows by 64 columns, N-major, which
// wgmma reads transposed. Measured on the way (M = 16384, 4096², r = 8): cp.async copies
// into an unswizzled layout reached 200 TFLOP/s with L2 at 89% of its throughput; TMA, 530.
#include "../common/common.cuh"
#include "launchers.h"
#include "tma.cuh"
#include "wgmma.cuh"

namespace bem {
namespace {

// Two consumer warpgroups of 64 rows each run the wgmma; one thread of a producer warpgroup issues every
// copy. The producer gives up registers (setmaxnreg) so that each consumer thread can hold its 128 + r / 2
// sums. The kernel is persistent (one block per multiprocessor walks the tiles), so the producer copies
// the next tile's first stages while the consumers finish the last one.
// Tiles are 128 rows by BN = 256 columns, or 128 where 256-column tiles would leave most multiprocessors
// idle (a few hundred rows: 512 x 4096 gives 64 tiles of 256 columns, 128 of 128).
constexpr int kBM = 128, kBK = 64, kConsumers = 256, kProducers = 128;
constexpr int kThreads = kConsumers + kProducers;

// PIN: s P ⊙ codes comes in ready (Pc), so the stages carry no V^T and the K loop computes no P.
template <int RN, int BN, bool PIN> struct GemmLayout {
  static_assert(BN == 128 || BN == 256, "tiles are 128 or 256 columns wide");
  // as many stages as fit in 227 KB
  static constexpr int stages = BN == 256 ? (RN <= 32 ? 4 : 3) : (RN <= 32 ? 6 : 5);
  static constexpr int RP = RN < 16 ? 16 : RN;      // rank padded to the k16 of the U step
  static constexpr int a_bytes = kBM * kBK * 2;
  static constexpr int w_bytes = BN * kBK * 2;      // also U's BN rows (64 columns, zeros past r)
  // V^T's RN rows, right after W's (RN >= 8: whole 1024-byte swizzle groups)
  static constexpr int v_bytes = PIN ? 0 : RN * kBK * 2;
  static constexpr int stage_bytes = a_bytes + w_bytes + v_bytes;
  static_assert(RP <= kBK, "U's rows must fit in one swizzled 128-byte row of W's slot");
  static constexpr int barrier_offset = stages * stage_bytes;
  // full and empty mbarriers per stage, and room to align the start to the swizzle's 1024 bytes
  static constexpr int total_bytes = barrier_offset + 2 * stages * 8 + 1024;
  static_assert(total_bytes <= 227 * 1024, "the stages must fit in shared memory");
};

struct GemmUpdateParams {  // besides the TMA maps of X, W, V^T and U
  const void* bias;
  const void* codes;
  const void* Pc;
  void* Y;
  float* P;
  int M, N, K, r, n_tiles, tiles;
  float scale;
};

template <typename T, int RN, int BN, bool PIN, bool WT>
__global__ void __launch_bounds__(kThreads, 1)
    gemm_update_kernel(const __grid_constant__ CUtensorMap x_map, const __grid_constant__ CUtensorMap w_map,
                       const __grid_constant__ CUtensorMap v_map, const __grid_constant__ CUtensorMap u_map,
                       GemmUpdateParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Lay = GemmLayout<RN, BN, PIN>;
  constexpr int kWtBoxBytes = 64 * kBK * 2;  // one box of a transposed weight's tile: 64 columns by kBK k-rows
  constexpr int RP = Lay::RP, kStages = Lay::stages;
  constexpr int PN = PIN ? 0 : RN;  // P's columns in the K loop's accumulators
  constexpr int kProducerRegs = 40, kConsumerRegs = 232;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const int tid = threadIdx.x, lane = tid % 32, warp = tid / 32;
  const int wg = warp / 4, wrow = (warp % 4) * 16;  // warpgroup, and the warp's 16 rows within it
  const int g = lane / 4, c = lane % 4;
  const int M = p.M, N = p.N, K = p.K, r = p.r;
  const int k_tiles = (K + kBK - 1) / kBK;
  const unsigned smem_base = smem_address(smem);
  // full[s]: the copies into stage s have landed; empty[s]: every consumer warp is done with it.
  const unsigned full_bar = smem_base + Lay::barrier_offset, empty_bar = full_bar + kStages * 8;
  if (tid == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_bar + 8 * s, 1);
      mbarrier_init(empty_bar + 8 * s, kConsumers / 32);
    }
  }
  __syncthreads();
  // Stage use number `it` (counted over all tiles) goes to stage it % kStages in round it / kStages.
  auto stage_of = [&](int it) { return smem_base + (it % kStages) * Lay::stage_bytes; };

  if (tid >= kConsumers) {  // the producer warpgroup
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (tid != kConsumers) return;
    int it = 0;
    auto acquire = [&](int bytes) {
      const int s = it % kStages, round = it / kStages;
      if (round > 0) mbarrier_wait(empty_bar + 8 * s, (round - 1) & 1);
      mbarrier_expect_bytes(full_bar + 8 * s, bytes);
      return full_bar + 8 * s;
    };
    // The column tiles of one row block are neighbours in tile order, so they share X in L2.
    for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
      const int m0 = (tile / p.n_tiles) * kBM, n0 = (tile % p.n_tiles) * BN;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const unsigned bar = acquire(Lay::stage_bytes), stage = stage_of(it);
        tma_load_2d(stage, &x_map, kt * kBK, m0, bar);
        if constexpr (WT) {
#pragma unroll
          for (int box = 0; box < BN / 64; ++box)
            tma_load_2d(stage + Lay::a_bytes + box * kWtBoxBytes, &w_map, n0 + 64 * box, kt * kBK, bar);
        } else {
          tma_load_2d(stage + Lay::a_bytes, &w_map, kt * kBK, n0, bar);
        }
        if constexpr (!PIN) tma_load_2d(stage + Lay::a_bytes + Lay::w_bytes, &v_map, kt * kBK, 0, bar);
      }
      const unsigned bar = acquire(Lay::w_bytes);  // U's rows for the tile go where W's were
      tma_load_2d(stage_of(it) + Lay::a_bytes, &u_map, 0, n0, bar);
      ++it;
    }
    return;
  }

  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kConsumerRegs));
  const T* bias = static_cast<const T*>(p.bias);
  T* Y = static_cast<T*>(p.Y);
  int it = 0;
  auto wait_full = [&](int use) { mbarrier_wait(full_bar + 8 * (use % kStages), (use / kStages) & 1); };
  auto release = [&](int use) {
    if (lane == 0) mbarrier_arrive(empty_bar + 8 * (use % kStages));
  };
  for (int tile = blockIdx.x; tile < p.tiles; tile += gridDim.x) {
    const int m0 = (tile / p.n_tiles) * kBM, n_tile = tile % p.n_tiles, n0 = n_tile * BN;
    // The codes for this tile's P (or s P ⊙ codes itself where it comes in ready), loaded now so that
    // their latency hides behind the K loop.
    const T* given = static_cast<const T*>(PIN ? p.Pc : p.codes);
    float factor[RN / 2];  // codes, or s P ⊙ codes itself
#pragma unroll
    for (int i = 0; i < RN / 2; ++i) {
      const int row = m0 + wg * 64 + wrow + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * c + i % 2;
      factor[i] = given == nullptr ? 1.f : (row < M && col < r ? to_acc(given[(size_t)row * r + col]) : 0.f);
    }
    // acc: Y's BN columns, then P = X V's RN; acc0 holds Y's first 128 columns (256-column tiles only),
    // acc1 the last 128 and P. V^T's rows follow W's in the stage, so one wgmma with N = 128 + RN covers
    // Y's last columns and P: one read of the X tile per step instead of two. A transposed W's tiles are
    // N-major and V^T's rows K-major, so there P takes a wgmma of its own.
    float acc[BN / 2 + PN / 2];
    float (&acc0)[64] = *reinterpret_cast<float(*)[64]>(acc);
    float (&acc1)[64 + PN / 2] = *reinterpret_cast<float(*)[64 + PN / 2]>(acc + BN / 2 - 64);
    float (&acc1_y)[64] = *reinterpret_cast<float(*)[64]>(acc + BN / 2 - 64);
    // byte offset of the last 128 rows of W (or U) in a stage; of a transposed W's last two boxes alike
    constexpr unsigned kLast = (BN - 128) * 128;
#pragma unroll
    for (int i = 0; i < BN / 2 + PN / 2; ++i) acc[i] = 0.f;

    for (int kt = 0; kt < k_tiles; ++kt, ++it) {
      wait_full(it);
      const unsigned a_base = stage_of(it);
      const unsigned w_base = a_base + Lay::a_bytes;
      wgmma_fence();
#pragma unroll
      for (int ks = 0; ks < kBK / 16; ++ks) {  // k16 step ks starts 32 bytes into each swizzled row
        const uint64_t da = wgmma_desc_sw128(a_base + wg * 64 * 128 + ks * 32);
        if constexpr (WT) {  // ... and 16 rows (2048 bytes) into each N-major box
          if constexpr (BN == 256)
            Wgmma<T, 128>::template ss<1>(acc0, da, wgmma_desc_sw128_n(w_base + ks * 2048, kWtBoxBytes));
          Wgmma<T, 128>::template ss<1>(acc1_y, da, wgmma_desc_sw128_n(w_base + kLast + ks * 2048, kWtBoxBytes));
          if constexpr (PN > 0)
            Wgmma<T, PN>::ss(*reinterpret_cast<float(*)[PN / 2]>(acc + BN / 2), da,
                             wgmma_desc_sw128(w_base + Lay::w_bytes + ks * 32));
        } else {
          if constexpr (BN == 256) Wgmma<T, 128>::ss(acc0, da, wgmma_desc_sw128(w_base + ks * 32));
          Wgmma<T, 128 + PN>::ss(acc1, da, wgmma_desc_sw128(w_base + kLast + ks * 32));
        }
      }
      wgmma_commit();
      // Step kt - 1's wgmma are done once at most this step's are pending: its stage goes back.
      wgmma_wait<1>();
      if (kt > 0) release(it - 1);
    }
    wgmma_wait<0>();
    release(it - 1);

    // s P ⊙ codes as the U step's A operands (the accumulator layout of P is the register-operand
    // layout of A); P itself (fp32) from the first column tile when asked for.
    float pc[RP / 2];
#pragma unroll
    for (int i = 0; i < RP / 2; ++i) {
      const int row = m0 + wg * 64 + wrow + g + 8 * ((i / 2) % 2), col = 8 * (i / 4) + 2 * c + i % 2;
      const bool live = i < RN / 2 && row < M && col < r;
      if constexpr (PIN) {
        pc[i] = live ? factor[i < RN / 2 ? i : 0] : 0.f;
      } else {
        const float v = i < RN / 2 ? acc1[64 + (i < RN / 2 ? i : 0)] : 0.f;
        if (live && p.P != nullptr && n_tile == 0) p.P[(size_t)row * r + col] = v;
        pc[i] = live ? p.scale * v * factor[i < RN / 2 ? i : 0] : 0.f;
      }
    }
    wait_full(it);
    const unsigned u_base = stage_of(it) + Lay::a_bytes;
    wgmma_fence();
#pragma unroll
    for (int q = 0; q < RP / 16; ++q) {
      uint32_t a[4];
#pragma unroll
      for (int k = 0; k < 4; ++k) a[k] = pack2(from_acc<T>(pc[8 * q + 2 * k]), from_acc<T>(pc[8 * q + 2 * k + 1]));
      if constexpr (BN == 256) Wgmma<T, 128>::rs(acc0, a, wgmma_desc_sw128(u_base + q * 32));
      Wgmma<T, 128>::rs(acc1_y, a, wgmma_desc_sw128(u_base + kLast + q * 32));
    }
    wgmma_commit();
    wgmma_wait<0>();
    release(it);
    ++it;

    // + bias, then Y in 16-byte stores: the four lanes of a quad hold two columns each of the same four
    // 8-column blocks, and two rounds of shuffles give each lane one block's eight columns.
    auto store = [&](const float (&acc)[64], int col0) {
      const bool odd = c & 1, upper = c & 2;
      uint32_t bias_pair[16];  // this lane's two bias values of each 8-column block, all loaded first
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = col0 + 8 * j + 2 * c;
        bias_pair[j] = bias != nullptr && col < N ? *reinterpret_cast<const uint32_t*>(bias + col) : 0u;
      }
#pragma unroll
      for (int q = 0; q < 4; ++q)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          uint32_t a[4];  // this lane's columns of blocks 4q .. 4q + 3, row g + 8 h
#pragma unroll
          for (int j = 0; j < 4; ++j) {
            const int i = 4 * (4 * q + j) + 2 * h;
            const T* b = reinterpret_cast<const T*>(&bias_pair[4 * q + j]);
            a[j] = pack2(from_acc<T>(acc[i] + to_acc(b[0])), from_acc<T>(acc[i + 1] + to_acc(b[1])));
          }
          // Round 1 (lanes c, c ^ 1): keep the blocks whose bit 0 is c's; lo / hi come from the even / odd lane.
          const uint32_t r0 = __shfl_xor_sync(0xffffffffu, odd ? a[0] : a[1], 1);
          const uint32_t r1 = __shfl_xor_sync(0xffffffffu, odd ? a[2] : a[3], 1);
          const uint32_t lo0 = odd ? r0 : a[0], hi0 = odd ? a[1] : r0;  // block (c & 1)
          const uint32_t lo2 = odd ? r1 : a[2], hi2 = odd ? a[3] : r1;  // block 2 + (c & 1)
          // Round 2 (lanes c, c ^ 2): keep block c, receive its words from the other pair.
          const uint32_t s_lo = __shfl_xor_sync(0xffffffffu, upper ? lo0 : lo2, 2);
          const uint32_t s_hi = __shfl_xor_sync(0xffffffffu, upper ? hi0 : hi2, 2);
          const uint32_t k_lo = upper ? lo2 : lo0, k_hi = upper ? hi2 : hi0;
          const uint4 out = upper ? make_uint4(s_lo, s_hi, k_lo, k_hi) : make_uint4(k_lo, k_hi, s_lo, s_hi);
          const int row = m0 + wg * 64 + wrow + g + 8 * h, col = col0 + 8 * (4 * q + c);
          if (row < M && col < N) *reinterpret_cast<uint4*>(Y + (size_t)row * N + col) = out;
        }
    };
    if constexpr (BN == 256) store(acc0, n0);
    store(acc1_y, n0 + BN - 128);
  }
#endif
}

// 1 where this build has the sm_90a kernels (the extension was built for sm_90a, e.g. TORCH_CUDA_ARCH_LIST=9.0a), else 0.
__global__ void gemm_update_probe_kernel(int* out) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  *out = 1;
#else
  *out = 0;
#endif
}

template <typename T, int RN, int BN, bool PIN, bool WT>
cudaError_t launch_for_tile(const GemmUpdateArgs& a, cudaStream_t stream) {
  constexpr auto kernel = gemm_update_kernel<T, RN, BN, PIN, WT>;
  constexpr int bytes = GemmLayout<RN, BN, PIN>::total_bytes;
  cudaError_t err = raise_smem_limit<kernel>(bytes);
  if (err != cudaSuccess) return err;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  CUtensorMap x_map, w_map, v_map{}, u_map;
  if ((err = encode_map(&x_map, a.X, a.M, a.K, kBM, bf16)) != cudaSuccess) return err;
  // W: N x K row-major in BN-row boxes, or (WT) K x N row-major in boxes of kBK rows by 64 columns
  if ((err = WT ? encode_map(&w_map, a.W, a.K, a.N, kBK, bf16) : encode_map(&w_map, a.W, a.N, a.K, BN, bf16)) !=
      cudaSuccess)
    return err;
  if (!PIN && (err = encode_map(&v_map, a.Vt, a.r, a.K, RN, bf16)) != cudaSuccess) return err;
  if ((err = encode_map(&u_map, a.U, a.N, a.r, BN, bf16)) != cudaSuccess) return err;
  GemmUpdateParams p{a.bias, a.codes, a.Pc, a.Y, a.P, a.M, a.N, a.K, a.r, 0, 0, a.scale};
  p.n_tiles = (a.N + BN - 1) / BN;
  p.tiles = (int)gemm_update_tiles(a.M, a.N, BN);  // below 2^31: gemm_update_fits
  const int blocks = p.tiles < a.num_sms ? p.tiles : a.num_sms;
  kernel<<<blocks, kThreads, bytes, stream>>>(x_map, w_map, v_map, u_map, p);
  return cudaGetLastError();
}

template <typename T, int RN>
cudaError_t launch_for_rank(const GemmUpdateArgs& a, cudaStream_t stream) {
  const int tile_n = a.tile_n != 0 ? a.tile_n : gemm_update_tile_n(a.M, a.N, a.num_sms);
  if (a.w_transposed && a.Pc != nullptr)
    return tile_n == 128 ? launch_for_tile<T, RN, 128, true, true>(a, stream)
                         : launch_for_tile<T, RN, 256, true, true>(a, stream);
  if (a.w_transposed)
    return tile_n == 128 ? launch_for_tile<T, RN, 128, false, true>(a, stream)
                         : launch_for_tile<T, RN, 256, false, true>(a, stream);
  if (a.Pc != nullptr)
    return tile_n == 128 ? launch_for_tile<T, RN, 128, true, false>(a, stream)
                         : launch_for_tile<T, RN, 256, true, false>(a, stream);
  return tile_n == 128 ? launch_for_tile<T, RN, 128, false, false>(a, stream)
                       : launch_for_tile<T, RN, 256, false, false>(a, stream);
}

}  // namespace

cudaError_t gemm_update_supported(int device, cudaStream_t stream, bool* supported) {
  static std::atomic<unsigned long long> known{0}, yes{0};  // one bit per device (64 and up: probed each call)
  const unsigned long long bit = device < 64 ? 1ull << device : 0;
  if (known.load() & bit) {
    *supported = (yes.load() & bit) != 0;
    return cudaSuccess;
  }
  // The probe copies its answer back, which a stream being captured into a graph cannot: such a call
  // takes the other paths, and a later call outside capture probes.
  cudaStreamCaptureStatus capture = cudaStreamCaptureStatusNone;
  cudaError_t err = cudaStreamIsCapturing(stream, &capture);
  if (err != cudaSuccess) return err;
  *supported = false;
  if (capture != cudaStreamCaptureStatusNone) return cudaSuccess;
  int major = 0;
  err = cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, device);
  if (err != cudaSuccess) return err;
  int found = 0;
  if (major == 9) {  // the sm_90a code runs on compute capability 9.0 only
    int* flag = nullptr;
    if ((err = cudaMalloc(&flag, sizeof(int))) != cudaSuccess) return err;
    gemm_update_probe_kernel<<<1, 1>>>(flag);
    err = cudaGetLastError();
    if (err == cudaSuccess) err = cudaMemcpy(&found, flag, sizeof(int), cudaMemcpyDeviceToHost);
    cudaFree(flag);
    // No code for this device in the build at all: the fused GEMM does not run (the other kernels say so).
    if (err == cudaErrorNoKernelImageForDevice) err = cudaSuccess;
    if (err != cudaSuccess) return err;
  }
  *supported = found == 1;
  if (found == 1) yes.fetch_or(bit);
  known.fetch_or(bit);
  return cudaSuccess;
}

long long gemm_update_tiles(int M, int N, int tile_n) {
  return (long long)((M + kBM - 1) / kBM) * ((N + tile_n - 1) / tile_n);
}

bool gemm_update_fills_wide(int M, int N, int num_sms) {
  return 2 * gemm_update_tiles(M, N, 256) >= num_sms;
}

int gemm_update_tile_n(int M, int N, int num_sms) {
  if (!gemm_update_fills_wide(M, N, num_sms)) return 128;
  const long long wide = gemm_update_tiles(M, N, 256), narrow = gemm_update_tiles(M, N, 128);
  // The persistent grid runs whole waves of tiles, and a 256-column tile takes about 1.7 times a 128-column
  // one: take the width with fewer such units. Fitted on an H100 (scripts/linear_mode_sweep.py, r = 8, x
  // F.linear, 256 / 128 columns): 192 tiles of 256 (1.45 waves) lost at 4096 x 1536² 1.31 / 1.22, 4096 x
  // 8960 -> 1536 1.22 / 1.19, and GPT-2's 768² and 3072 -> 768 at 8192 rows 1.66 / 1.44 and 1.29 / 1.19;
  // where the 256-column waves were nearly whole they won (1536 -> 8960, 4096 rows: 1.18 / 1.29; GPT-2's
  // 768 -> 2304 and 768 -> 3072 at 8192 rows: 1.25 / 1.34 and 1.20 / 1.34).
  const long long waves_wide = (wide + num_sms - 1) / num_sms, waves_narrow = (narrow + num_sms - 1) / num_sms;
  return 10 * waves_narrow < 17 * waves_wide ? 128 : 256;
}

bool gemm_update_fits(const GemmUpdateArgs& a) {
  const long long tiles = gemm_update_tiles(a.M, a.N, 128);
  return (a.tile_n == 0 || a.tile_n == 128 || a.tile_n == 256) && a.M > 0 && a.K > 0 && a.K % 8 == 0 &&
         a.N % 8 == 0 && a.r >= 1 && a.r % 8 == 0 && a.r <= kGemmUpdateMaxRank && aligned16(a.X) &&
         aligned16(a.W) && (a.Pc != nullptr || (a.Vt != nullptr && aligned16(a.Vt))) &&
         aligned16(a.U) &&
         aligned16(a.Y) &&
         reinterpret_cast<uintptr_t>(a.bias) % 4 == 0 && tiles < INT32_MAX && a.num_sms > 0;
}

cudaError_t launch_gemm_update(DType dtype, const GemmUpdateArgs& a, cudaStream_t stream) {
  if (!gemm_update_fits(a)) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (a.r <= 8) return launch_for_rank<T, 8>(a, stream);
    if (a.r <= 16) return launch_for_rank<T, 16>(a, stream);
    if (a.r <= 32) return launch_for_rank<T, 32>(a, stream);
    return launch_for_rank<T, 64>(a, stream);
  });
}

}  // namespace bem
