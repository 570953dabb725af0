// The generated update s ((A B) ⊙ codes) U^T (+ bias) at prefill sizes on Hopper (sm_90a, fp16/bf16),
// reading A once and writing Y once, A in and Y out through TMA.
//
// The update moves as many bytes in as out (A: M x L, Y: M x N) and computes almost nothing, so its speed
// is the memory system's: phases that read and phases that write must run at the same time. One
// persistent block per multiprocessor walks tiles of 64 rows with four warpgroups in a pipeline:
// - one thread of the first brings A's tile and B^T (r x L) into a ring of stages (TMA, 128-byte swizzle);
// - the second (the reader) multiplies them on the tensor cores (wgmma, P = A B for 64 rows, fp32) and
//   hands s P ⊙ codes, already in the register layout of a wgmma A operand, to the writers through one of
//   two shared-memory buffers; it then goes on to the next tile's A;
// - the third and fourth (the writers) take Y's 128-column blocks in turn: each multiplies s P ⊙ codes by
//   128 of U's rows (copied with cp.async, only the padded rank wide), adds the bias and stores the 64 x 128
//   block with TMA from one of its two staging buffers, so a store drains while the next is computed.
// While the writers write tile t's Y, the reader reads tile t + 1's A; two writers, because one block's
// steps (wait for U, wgmma, staging, barriers, store) are a chain of latencies that one warpgroup alone
// left exposed.
#include "../common/common.cuh"
#include "launchers.h"
#include "tma.cuh"
#include "wgmma.cuh"

#include <algorithm>

namespace bem {
namespace {

constexpr int kRows = kLowRankTmaTileRows;  // tokens per tile: the rows of one warpgroup's wgmma
constexpr int kBK = 64;      // A's columns per stage: one swizzled 128-byte row
constexpr int kCols = 128;   // Y's columns per block: two 64-column TMA boxes
constexpr int kWriters = 2;
constexpr int kThreads = 128 * (2 + kWriters);
constexpr int kSmemBudget = 227 * 1024;
// The producer needs few registers, the reader keeps the 128 of the launch (65536 / 512 threads), the
// writers hold 64 sums, s P ⊙ codes and the bias.
constexpr int kProducerRegs = 40, kReaderRegs = 65536 / kThreads, kWriterRegs = 168;
static_assert(kProducerRegs + kReaderRegs + kWriters * kWriterRegs <= 65536 / 128, "register file");

template <int RN> struct TmaLayout {
  static constexpr int RP = RN < 16 ? 16 : RN;          // the rank padded to the writer's k16 steps
  static constexpr int YB = 2, UB = RP <= 32 ? 4 : 2;   // staging and U buffers per writer
  static constexpr int a_bytes = kRows * kBK * 2;       // 64 rows x 64 columns of A, 8 KB
  static constexpr int v_bytes = RN * kBK * 2;          // B^T's RN rows (RN >= 8: whole 1024-byte swizzle groups)
  static constexpr int stage_bytes = a_bytes + v_bytes;
  static constexpr int u_bytes = kCols * RP * 2;        // 128 of U's rows, RP ranks (zeros past r)
  static constexpr int y_bytes = kRows * kCols * 2;     // 64 x 128 of Y, as two 64 x 64 swizzled boxes
  static constexpr int pc_bytes = RP / 16 * 4 * 128 * 4;  // 4 words per k16 step for each of 128 threads
  static constexpr int fixed_bytes = kWriters * (UB * u_bytes + YB * y_bytes) + 2 * pc_bytes + 1024 + 256;
  static constexpr int stages_fit = (kSmemBudget - fixed_bytes) / stage_bytes;
  static constexpr int stages = stages_fit > 16 ? 16 : stages_fit;
  static constexpr int u_offset = stages * stage_bytes;  // a multiple of 1024, as the swizzle wants
  static constexpr int y_offset = u_offset + kWriters * UB * u_bytes;
  static constexpr int pc_offset = y_offset + kWriters * YB * y_bytes;
  static constexpr int barrier_offset = pc_offset + 2 * pc_bytes;
  // full and empty per stage; s P ⊙ c full and empty per buffer; U full per writer and buffer
  static constexpr int total_bytes = barrier_offset + (2 * stages + 4 + kWriters * UB) * 8 + 1024;
  static_assert(stages >= 4, "the ring needs stages in flight");
  static_assert(y_offset % 1024 == 0, "the staging buffers' 128-byte swizzle repeats every 1024 bytes");
  static_assert(total_bytes <= kSmemBudget, "shared memory plan too large");
};

struct TmaParams {  // besides the TMA maps of A, B^T and Y
  const void* U;
  const void* codes;
  const void* bias;
  float* P;
  int M, N, L, r;
  int items, splits;  // work items: a tile of rows and one of `splits` interleaved shares of Y's column blocks
  float scale;
};

template <typename T, int RN>
__global__ void __launch_bounds__(kThreads, 1)
    lowrank_tma_kernel(const __grid_constant__ CUtensorMap a_map, const __grid_constant__ CUtensorMap bt_map,
                       const __grid_constant__ CUtensorMap y_map, TmaParams p) {
#if defined(__CUDA_ARCH_FEAT_SM90_ALL)
  using Lay = TmaLayout<RN>;
  constexpr int UB = Lay::UB, YB = Lay::YB, kStages = Lay::stages, kSteps = Lay::RP / 16;
  extern __shared__ __align__(1024) unsigned char smem_raw[];
  unsigned char* smem = smem_raw + ((1024 - (smem_address(smem_raw) & 1023)) & 1023);
  const unsigned base = smem_address(smem);
  const int role = threadIdx.x / 128, t = threadIdx.x % 128;
  const int warp = t / 32, lane = t % 32, g = lane / 4, c = lane % 4;
  const int M = p.M, N = p.N, r = p.r;
  const int k_tiles = (p.L + kBK - 1) / kBK;
  const unsigned full_bar = base + Lay::barrier_offset, empty_bar = full_bar + 8 * kStages;
  const unsigned pc_full = empty_bar + 8 * kStages, pc_empty = pc_full + 16, u_full = pc_empty + 16;
  if (threadIdx.x == 0) {
    for (int s = 0; s < kStages; ++s) {
      mbarrier_init(full_bar + 8 * s, 1);
      mbarrier_init(empty_bar + 8 * s, 4);  // one arrival per reader warp
    }
    for (int b = 0; b < 2; ++b) {
      mbarrier_init(pc_full + 8 * b, 128);
      mbarrier_init(pc_empty + 8 * b, 128 * kWriters);
    }
    for (int b = 0; b < kWriters * UB; ++b) mbarrier_init(u_full + 8 * b, 128);  // every writer thread's copies
  }
  __syncthreads();
  auto stage_of = [&](int it) { return base + (it % kStages) * Lay::stage_bytes; };

  if (role == 0) {  // the producer: one thread issues every copy of A and B^T
    asm volatile("setmaxnreg.dec.sync.aligned.u32 %0;\n" ::"n"(kProducerRegs));
    if (t != 0) return;
    int it = 0;
    for (int item = blockIdx.x; item < p.items; item += gridDim.x)
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        const int s = it % kStages, round = it / kStages;
        if (round > 0) mbarrier_wait(empty_bar + 8 * s, (round - 1) & 1);
        const unsigned bar = full_bar + 8 * s, stage = stage_of(it);
        mbarrier_expect_bytes(bar, Lay::stage_bytes);
        tma_load_2d(stage, &a_map, kt * kBK, item / p.splits * kRows, bar);
        tma_load_2d(stage + Lay::a_bytes, &bt_map, kt * kBK, 0, bar);
      }
    return;
  }

  if (role == 1) {  // the reader: P = A B for a tile, then s P ⊙ codes to the writers
    const T* codes = static_cast<const T*>(p.codes);
    int it = 0, local = 0;
    const bool writes_p = p.P != nullptr && blockIdx.x % p.splits == 0;  // one share of a tile writes P
    for (int item = blockIdx.x; item < p.items; item += gridDim.x, ++local) {
      const int m0 = item / p.splits * kRows;
      // Value i of the accumulators: row 16 warp + g + 8 ((i / 2) % 2), rank 8 (i / 4) + 2 c + i % 2.
      auto row_of = [&](int i) { return m0 + 16 * warp + g + 8 * ((i / 2) % 2); };
      auto rank_of = [&](int i) { return 8 * (i / 4) + 2 * c + i % 2; };
      float code[RN / 2];  // loaded before the K loop, which hides their latency
#pragma unroll
      for (int i = 0; i < RN / 2; ++i) {
        const bool live = row_of(i) < M && rank_of(i) < r;
        code[i] = !live ? 0.f : codes == nullptr ? 1.f : to_acc(codes[(size_t)row_of(i) * r + rank_of(i)]);
      }
      float acc[RN / 2];
#pragma unroll
      for (int i = 0; i < RN / 2; ++i) acc[i] = 0.f;
      for (int kt = 0; kt < k_tiles; ++kt, ++it) {
        mbarrier_wait(full_bar + 8 * (it % kStages), (it / kStages) & 1);
        const unsigned stage = stage_of(it);
        wgmma_fence();
#pragma unroll
        for (int ks = 0; ks < kBK / 16; ++ks)  // k16 step ks starts 32 bytes into each swizzled row
          Wgmma<T, RN>::ss(acc, wgmma_desc_sw128(stage + ks * 32), wgmma_desc_sw128(stage + Lay::a_bytes + ks * 32));
        wgmma_commit();
        wgmma_wait<1>();  // the previous step's wgmma are done: its stage goes back
        if (kt > 0 && lane == 0) mbarrier_arrive(empty_bar + 8 * ((it - 1) % kStages));
      }
      wgmma_wait<0>();
      if (lane == 0) mbarrier_arrive(empty_bar + 8 * ((it - 1) % kStages));

      const int b = local % 2;
      if (local >= 2) mbarrier_wait(pc_empty + 8 * b, ((local - 2) / 2) & 1);
      uint32_t* out = reinterpret_cast<uint32_t*>(smem + Lay::pc_offset + b * Lay::pc_bytes);
      // The accumulator layout of P is the register-operand layout of the writers' A: word k of k16 step
      // q packs values 8 q + 2 k and 8 q + 2 k + 1 (the same rows and rank pair), for the writers' thread t.
#pragma unroll
      for (int q = 0; q < kSteps; ++q)
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          float pc[2];
#pragma unroll
          for (int e = 0; e < 2; ++e) {
            const int i = 8 * q + 2 * k + e;
            const int ii = i < RN / 2 ? i : 0;
            const bool live = i < RN / 2 && row_of(ii) < M && rank_of(ii) < r;
            if (live && writes_p) p.P[(size_t)row_of(ii) * r + rank_of(ii)] = acc[ii];
            pc[e] = live ? p.scale * acc[ii] * code[ii] : 0.f;
          }
          out[(q * 4 + k) * 128 + t] = pack2(from_acc<T>(pc[0]), from_acc<T>(pc[1]));
        }
      mbarrier_arrive(pc_full + 8 * b);
    }
    return;
  }

  // A writer: Y = (s P ⊙ codes) U^T (+ bias), 64 x 128 at a time: every kWriters-th column block of the
  // block's share of each tile, from the w-th on.
  asm volatile("setmaxnreg.inc.sync.aligned.u32 %0;\n" ::"n"(kWriterRegs));
  const int w = role - 2;
  const T* bias = static_cast<const T*>(p.bias);
  const int n_blocks = (N + kCols - 1) / kCols;
  // This block's share of the column blocks (the grid is a multiple of p.splits: the same share for every
  // item it takes), and this writer's turn within it: nb = first, first + stride, ...
  const int stride = p.splits * kWriters, first = (int)blockIdx.x % p.splits + p.splits * w;
  const int my_blocks = first < n_blocks ? (n_blocks - first + stride - 1) / stride : 0;  // of each item
  const int my_items = (p.items - (int)blockIdx.x + (int)gridDim.x - 1) / (int)gridDim.x;
  const int total = my_items * my_blocks;  // blocks this writer writes, over all its items
  const unsigned u_base = base + Lay::u_offset + w * UB * Lay::u_bytes;
  const unsigned y_base = base + Lay::y_offset + w * YB * Lay::y_bytes;
  const unsigned u_bar = u_full + w * UB * 8;
  // The writer's block q (counted over the items) takes its U buffer q % UB and staging buffer q % YB.
  // U's 128 rows (contiguous, r / 8 16-byte chunks each) come in with cp.async, consecutive threads
  // copying consecutive chunks, into the unswizzled K-major layout of wgmma: 8-row x 16-byte core
  // matrices, row group i and rank chunk j at (16 j + i) x 128 bytes, so a buffer holds only the padded
  // rank (as TMA boxes of 64 columns, U's rows of 8 to 32 ranks cost more than the rest of the block).
  // The chunks from r / 8 up to the padded rank are zeros, written once.
  const int chunks = r / 8;
  auto u_chunk = [&](int buffer, int row, int j) {
    return u_base + buffer * Lay::u_bytes + (16 * j + row / 8) * 128 + (row % 8) * 16;
  };
  for (int b = 0; b < UB; ++b)
    for (int j = chunks; j < Lay::RP / 8; ++j)
      asm volatile("st.shared.v4.u32 [%0], {%1, %1, %1, %1};\n" ::"r"(u_chunk(b, t, j)), "r"(0) : "memory");
  auto load_u = [&](int q) {
    if (q >= total) return;
    const int n0 = (first + stride * (q % my_blocks)) * kCols;
    const T* block = static_cast<const T*>(p.U) + (size_t)n0 * r;
    for (int e = t; e < kCols * chunks; e += 128) {
      const int row = e / chunks, j = e - row * chunks;
      const bool in = n0 + row < N;
      asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(u_chunk(q % UB, row, j)),
                   "l"(in ? block + 8 * e : block), "r"(in ? 16 : 0) : "memory");
    }
    cp_async_mbarrier_arrive(u_bar + 8 * (q % UB));
  };
  for (int q = 0; q < UB; ++q) load_u(q);
  int q = 0, local = 0;
  for (int item = blockIdx.x; item < p.items; item += gridDim.x, ++local) {
    const int m0 = item / p.splits * kRows, b = local % 2;
    mbarrier_wait(pc_full + 8 * b, (local / 2) & 1);
    const uint32_t* in = reinterpret_cast<const uint32_t*>(smem + Lay::pc_offset + b * Lay::pc_bytes);
    uint32_t a[kSteps][4];
#pragma unroll
    for (int s = 0; s < kSteps; ++s)
#pragma unroll
      for (int k = 0; k < 4; ++k) a[s][k] = in[(s * 4 + k) * 128 + t];
    mbarrier_arrive(pc_empty + 8 * b);

    for (int nb = first; nb < n_blocks; nb += stride, ++q) {
      const int n0 = nb * kCols, ub = q % UB, yb = q % YB;
      // This lane's two bias values in each 8-column group, requested before the wgmma.
      uint32_t bias_pair[16];
#pragma unroll
      for (int j = 0; j < 16; ++j) {
        const int col = n0 + 8 * j + 2 * c;
        bias_pair[j] = bias != nullptr && col < N ? *reinterpret_cast<const uint32_t*>(bias + col) : 0u;
      }
      mbarrier_wait(u_bar + 8 * ub, (q / UB) & 1);
      fence_proxy_async();  // the copies (generic proxy) become visible to wgmma's reads
      float acc[64];
#pragma unroll
      for (int i = 0; i < 64; ++i) acc[i] = 0.f;
      wgmma_fence();
#pragma unroll
      for (int s = 0; s < kSteps; ++s)  // k16 step s: rank chunks 2 s and 2 s + 1, 2048 bytes apart
        Wgmma<T, 128>::rs(acc, a[s], wgmma_desc(u_base + ub * Lay::u_bytes + s * 4096, 2048, 128));
      wgmma_commit();
      wgmma_wait<0>();
      // Staging buffer `yb` was last read by the store of block q - YB: at most the YB - 1 newer stores may
      // still be reading. After the barrier U buffer `ub` is free too (every warp's wgmma is done).
      if (t == 0) bulk_wait_read<YB - 1>();
      named_barrier(1 + w, 128);
      load_u(q + UB);
      // Value i: row 16 warp + g + 8 ((i / 2) % 2), column 8 (i / 4) + 2 c + i % 2 of the 64 x 128 block;
      // 8-column group j = i / 4 lies in box j / 8, 16-byte chunk j % 8 of its row, swizzled by the row.
      const unsigned y = y_base + yb * Lay::y_bytes;
#pragma unroll
      for (int i = 0; i < 64; i += 2) {
        const int j = i / 4, row = 16 * warp + g + 8 * ((i / 2) % 2);
        const T* bv = reinterpret_cast<const T*>(&bias_pair[j]);
        const uint32_t v = pack2(from_acc<T>(acc[i] + to_acc(bv[0])), from_acc<T>(acc[i + 1] + to_acc(bv[1])));
        const unsigned address = y + (j / 8) * (kRows * 128) + row * 128 + (((j % 8) ^ (row % 8)) * 16) + 4 * c;
        asm volatile("st.shared.u32 [%0], %1;\n" ::"r"(address), "r"(v) : "memory");
      }
      fence_proxy_async();  // the stores above become visible to the TMA store's reads
      named_barrier(1 + w, 128);
      if (t == 0) {
        tma_store_2d(&y_map, n0, m0, y);
        if (n0 + 64 < N) tma_store_2d(&y_map, n0 + 64, m0, y + kRows * 128);
        bulk_commit();
      }
    }
  }
  if (t == 0) bulk_wait<0>();
#endif
}

template <typename T, int RN>
cudaError_t launch_for_rank(const LowRankArgs& a, cudaStream_t stream) {
  constexpr auto kernel = lowrank_tma_kernel<T, RN>;
  constexpr int bytes = TmaLayout<RN>::total_bytes;
  cudaError_t err = raise_smem_limit<kernel>(bytes);
  if (err != cudaSuccess) return err;
  constexpr bool bf16 = std::is_same<T, __nv_bfloat16>::value;
  CUtensorMap a_map, bt_map, y_map;
  if ((err = encode_map(&a_map, a.A, a.M, a.L, kRows, bf16)) != cudaSuccess) return err;
  if ((err = encode_map(&bt_map, a.Bt, a.r, a.L, RN, bf16)) != cudaSuccess) return err;
  if ((err = encode_map(&y_map, a.Y, a.M, a.N, kRows, bf16)) != cudaSuccess) return err;
  // Fewer tiles of rows than multiprocessors: each tile's column blocks are shared among `splits` blocks,
  // neighbours in the grid, which each compute P for the tile (its second reads of A come from L2).
  const int tiles = (a.M + kRows - 1) / kRows, n_blocks = (a.N + kCols - 1) / kCols;
  const int splits = std::max(1, std::min(n_blocks, a.num_sms / tiles));
  TmaParams p{a.U, a.codes, a.bias, static_cast<float*>(a.P), a.M, a.N, a.L, a.r, tiles * splits, splits,
              static_cast<float>(a.scale)};
  const int blocks = std::min(p.items, a.num_sms / splits * splits);
  kernel<<<blocks, kThreads, bytes, stream>>>(a_map, bt_map, y_map, p);
  return cudaGetLastError();
}

}  // namespace

bool lowrank_tma_fits(const LowRankArgs& a) {
  // TMA: 16-byte aligned bases and row pitches (L, N and r multiples of 8); the bias is read in pairs.
  return a.expand && !a.accumulate && a.P_in == nullptr && a.M > 0 && a.L % 8 == 0 && a.N % 8 == 0 &&
         a.r % 8 == 0 && a.r >= 8 && a.r <= kLowRankTmaMaxRank && aligned16(a.A) &&
         aligned16(a.U) && aligned16(a.Y) && reinterpret_cast<uintptr_t>(a.bias) % 4 == 0 && a.num_sms > 0;
}

cudaError_t launch_lowrank_tma(DType dtype, const LowRankArgs& args, cudaStream_t stream) {
  if (!lowrank_tma_fits(args) || args.Bt == nullptr || !aligned16(args.Bt)) return cudaErrorInvalidValue;
  return dispatch_half(dtype, [&](auto tag) {
    using T = typename decltype(tag)::type;
    if (args.r <= 8) return launch_for_rank<T, 8>(args, stream);
    if (args.r <= 16) return launch_for_rank<T, 16>(args, stream);
    if (args.r <= 32) return launch_for_rank<T, 32>(args, stream);
    return launch_for_rank<T, 64>(args, stream);
  });
}

}  // namespace bem
