// The filter's gradient of the fftconv op on tensor cores, bfloat16 rows, 1024 <= M <= 8192 (a complex FFT of
// N = 2M points), Hopper and later: the tensor-core forward's passes (fftconv_tc_block.cuh, fftconv_tc_rows.cuh)
// on pairs of g's and v's rows, and dD beside it. scripts/fftconv_tc_model.py's filter_grad_tc is its model.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "fftconv.h"
#include "fftconv_tc_block.cuh"
#include "fftconv_tc_rows.cuh"

namespace bem {
namespace fftconv {
namespace {

using namespace tc;  // fftconv_tc_block.cuh, fftconv_tc_plan.cuh, fftconv_tc_rows.cuh

// The filter's gradient, dk[h, j] = sum_b sum_t g[b, h, t] v[b, h, t - j] (g = dy ⊙ postgate, v = u ⊙ pregate),
// per (h, pair of batch rows): with zg = s (g1 + i g2) and zv = s' (v1 + i v2), one scale a pair each,
// Re IFFT(Zg conj(Zv)) = s s' (corr(g1, v1) + corr(g2, v2)) (the cross terms come back imaginary). zg goes through
// the forward passes and its spectrum stays in this pipeline's table; zv through the forward passes, the product
// and the inverse passes. Each pipeline has its own planes and table: the table in shared memory up to N = 8192, in
// global memory (L2) at 16384, where two pipelines' planes and tables would take 256 KB. The blocks loop over the
// (head, chunk of pairs) items, so that the global tables are one per resident block.
// Each pipeline adds its pairs' shares into its own float32 row in shared memory; at the item's end the block sums
// its pipelines' rows into dk itself (one chunk a head) or into the chunk's share. With dD_part, each warp also
// writes its share of dD = sum_b sum_t g v for each pair, the products taken as v's rows are read (float32).
struct GradParams {
  const __nv_bfloat16* dy;
  const __nv_bfloat16* postgate;
  const __nv_bfloat16* u;
  const __nv_bfloat16* pregate;
  void* dk;         // (H, Lk) of dk_dtype, zero past taps: where a head is one chunk
  float* dk_part;   // else (H, chunks, taps)
  float* dD_part;   // (H, pairs, kPipeWarps) or null
  uint32_t* table;  // N = 16384: gridDim.x * kPipes tables of N words
  int B, H, L, Lk, taps, chunks;
  Dtype dk_dtype;
  bool vec;
};

template <int N>
struct GradShape {
  static constexpr bool kGlobalTable = N > 8192;
  static constexpr int kTablesBytes = kGlobalTable ? 0 : kPipes * 4 * N;  // each pipeline's kept spectrum
  static constexpr int kTwiddleOffset = TcShape<N>::kSpectrumOffset + kTablesBytes;
  static constexpr int kScratchOffset = kTwiddleOffset + 2 * 256 * 8;
  static constexpr int kRowsOffset = kScratchOffset + kPipes * kPipeWarps * 2 * 4;
  static constexpr int kSmemBytes = kRowsOffset + kPipes * (N / 2) * 4;  // each pipeline's float32 row of dk (L <= N / 2)
};

// x, as a value the compiler cannot see through. Each CUDA-core pass takes its thread index through it, so that it
// computes its own twiddles and addresses: otherwise the compiler kept the first pass's (about a hundred values)
// live across the tensor-core passes for the second, and spilled them (476 bytes a thread at N = 16384, 36 at 8192).
__device__ __forceinline__ int opaque(int x) {
  asm volatile("" : "+r"(x));
  return x;
}

__device__ __forceinline__ void store_as(void* base, int64_t at, Dtype dtype, float v) {
  switch (dtype) {
    case Dtype::kFloat: static_cast<float*>(base)[at] = v; break;
    case Dtype::kBFloat16: static_cast<__nv_bfloat16*>(base)[at] = __float2bfloat16_rn(v); break;
    case Dtype::kHalf: static_cast<__half*>(base)[at] = __float2half_rn(v); break;
  }
}

// the block's pipelines' rows of an item summed into dk (one chunk a head) or the chunk's share (its own function:
// inlined, the values it keeps across the item's pairs took registers the passes needed)
__device__ __noinline__ void combine_rows(const float* block_rows, int used, int taps, void* dk, Dtype dk_dtype, int Lk,
                                          float* dk_part, int64_t at) {
  const int width = dk != nullptr ? Lk : taps;
  for (int j = threadIdx.x; j < width; j += kThreads) {
    float v = 0.f;
    if (j < taps)
      for (int p = 0; p < used; ++p) v += block_rows[p * taps + j];
    if (dk != nullptr)
      store_as(dk, at * Lk + j, dk_dtype, v);
    else
      dk_part[at * taps + j] = v;
  }
}

template <int N>
__global__ void __launch_bounds__(kThreads, tc_min_blocks<N>()) tc_filter_grad_kernel(const GradParams q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = TcShape<N>;
  using Block = TcBlock<N>;
  using Pass = Simt<N>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int pairs = (q.B + 1) / 2;
  const int per_chunk = (pairs + q.chunks - 1) / q.chunks;
  const int pipe = threadIdx.x / kPipeThreads;

  float2* tables = reinterpret_cast<float2*>(smem + GradShape<N>::kTwiddleOffset);
  Block blk = Block::place(smem, pipe, tables, reinterpret_cast<float*>(smem + GradShape<N>::kScratchOffset));
  blk.spectrum = GradShape<N>::kGlobalTable ? q.table + ((int64_t)blockIdx.x * kPipes + pipe) * N
                                            : reinterpret_cast<uint32_t*>(smem + Shape::kSpectrumOffset + pipe * 4 * N);
  Block::build_twiddles(tables);
  __syncthreads();

  // g's and v's rows through the CUDA-core pass as its "u" and "pregate" (built where used: kept alive across the
  // loop, their fields took registers)
  auto rows = [&](const __nv_bfloat16* a, const __nv_bfloat16* gate) {
    return TcParams{a, gate, nullptr, nullptr, nullptr, nullptr, q.B, q.H, q.L, q.chunks, false, q.vec, false};
  };
  const Dft16 dft(blk.lane);
  auto reduce = [&](float2 m) { return blk.pipe_max(m, pipe); };
  float* const block_rows = reinterpret_cast<float*>(smem + GradShape<N>::kRowsOffset);
  for (int item = blockIdx.x; item < q.H * q.chunks; item += gridDim.x) {
  const int h = item / q.chunks, chunk = item % q.chunks;
  const int first = chunk * per_chunk, last = min(pairs, first + per_chunk);
  for (int pair = first + pipe; pair < last; pair += kPipes) {
    const int b1 = 2 * pair;
    const bool two = b1 + 1 < q.B;
    const int64_t row1 = ((int64_t)b1 * q.H + h) * q.L, row2 = ((int64_t)(b1 + 1) * q.H + h) * q.L;
    float sg, sv, unused;
    Pass::template forward<true, true>(rows(q.dy, q.postgate), row1, row2, two, blk.re, blk.im, opaque(blk.tid), reduce,
                                       sg, unused);
    pipe_sync(pipe);
    // v's rows into L2 while the tensor cores work (the forward kernel's prefetch; without it, the passes' loads
    // from DRAM were the kernel's largest stall)
    for (int r = 0; r < (two ? 2 : 1); ++r) {
      prefetch_row_l2(q.u + (r == 0 ? row1 : row2), q.L, blk.tid, kPipeThreads);
      if (q.pregate) prefetch_row_l2(q.pregate + (r == 0 ? row1 : row2), q.L, blk.tid, kPipeThreads);
    }
    blk.template spectral_passes<Product::kStore>(dft, pipe);
    Pass::template forward<true, true>(rows(q.u, q.pregate), row1, row2, two, blk.re, blk.im, opaque(blk.tid), reduce,
                                       sv, unused);
    if (q.dD_part != nullptr) {  // the rows again, just read (L2)
      float d = Pass::dot(rows(q.dy, q.postgate), rows(q.u, q.pregate), row1, row2, two, blk.tid);
#pragma unroll
      for (int o = 16; o > 0; o >>= 1) d += __shfl_xor_sync(0xffffffffu, d, o);
      if (blk.lane == 0) q.dD_part[((int64_t)h * pairs + pair) * kPipeWarps + blk.warp] = d;
    }
    pipe_sync(pipe);
    if (pair + kPipes < last) {  // the next pair's g rows, likewise
      const int b3 = b1 + 2 * kPipes;
      for (int r = 0; r < (b3 + 1 < q.B ? 2 : 1); ++r) {
        const int64_t row = ((int64_t)(b3 + r) * q.H + h) * q.L;
        prefetch_row_l2(q.dy + row, q.L, blk.tid, kPipeThreads);
        if (q.postgate) prefetch_row_l2(q.postgate + row, q.L, blk.tid, kPipeThreads);
      }
    }
    blk.template spectral_passes<Product::kConjugateStored>(dft, pipe);
    // unitary passes: Fu^H (Fu g conj(Fu v)) = IFFT(G conj V) / sqrt(N)
    Pass::inverse_real(block_rows + pipe * q.taps, q.taps, sqrtf((float)N) / (sg * sv), pair >= first + kPipes,
                       blk.re, blk.im, blk.tid);
    pipe_sync(pipe);
  }
  __syncthreads();  // both pipelines' rows written (and visible to the block)
  // dk's row h, or the share (h, chunk)
  combine_rows(block_rows, max(0, min(kPipes, last - first)), q.taps, q.dk, q.dk_dtype, q.Lk, q.dk_part,
               q.dk != nullptr ? (int64_t)h : (int64_t)h * q.chunks + chunk);
  __syncthreads();  // the rows are read before the next item writes them
  }
#endif
}

// the chunks of a head's pairs, the blocks, and the scratch a launch needs
template <int N>
TcFilterGradPlan filter_grad_plan(int B, int H, int num_sms) {
  TcFilterGradPlan plan;
  const int resident = resident_blocks(tc_filter_grad_kernel<N>, kThreads, GradShape<N>::kSmemBytes);
  if (resident == 0 || H == 0) return plan;
  plan.chunks = pair_chunks(B, H, resident, num_sms);
  plan.grid = grid_for((int64_t)H * plan.chunks, resident, num_sms);  // the blocks loop over the items
  plan.table_words = GradShape<N>::kGlobalTable ? (int64_t)plan.grid * kPipes * N : 0;
  plan.dD_per_head = (int64_t)(B + 1) / 2 * kPipeWarps;
  return plan;
}

template <int N>
cudaError_t launch_filter_grad(const TcFilterGradArgs& a, const TcFilterGradPlan& plan, cudaStream_t stream) {
  if (plan.grid <= 0 || (GradShape<N>::kGlobalTable && a.table == nullptr) ||
      (a.dk == nullptr) == (a.dk_part == nullptr) || (a.dk != nullptr && plan.chunks != 1))
    return cudaErrorInvalidValue;
  const bool vec = rows_vectorizable(a.L, {a.dy, a.postgate, a.u, a.pregate});
  const GradParams q{static_cast<const __nv_bfloat16*>(a.dy), static_cast<const __nv_bfloat16*>(a.postgate),
                     static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate), a.dk,
                     a.dk_part, a.dD_part, a.table, a.B, a.H, a.L, a.Lk, a.taps, plan.chunks, a.dk_dtype, vec};
  tc_filter_grad_kernel<N><<<(unsigned)plan.grid, kThreads, GradShape<N>::kSmemBytes, stream>>>(q);
  return cudaGetLastError();
}

}  // namespace

bool tc_filter_grad_takes(Dtype dtype, int M, int cc_major, int smem_optin) {
  if (dtype != Dtype::kBFloat16 || cc_major < 9) return false;
  return with_tc_length(M, false, [&](auto n) { return GradShape<decltype(n)::value>::kSmemBytes <= smem_optin; });
}

TcFilterGradPlan tc_filter_grad_plan(int M, int B, int H, int num_sms) {
  return with_tc_length(M, TcFilterGradPlan{},
                        [&](auto n) { return filter_grad_plan<decltype(n)::value>(B, H, num_sms); });
}

cudaError_t launch_tc_filter_grad(int M, const TcFilterGradArgs& args, const TcFilterGradPlan& plan,
                                  cudaStream_t stream) {
  return with_tc_length(M, cudaErrorInvalidValue,
                        [&](auto n) { return launch_filter_grad<decltype(n)::value>(args, plan, stream); });
}

}  // namespace fftconv
}  // namespace bem
