// The tensor-core forward of the fftconv op for bfloat16 rows, 1024 <= M <= 8192 (a complex FFT of N = 2M
// points), Hopper and later. scripts/fftconv_tc_model.py is its lane-level model (same positions, fragments,
// twiddles and roundings), checked against a float64 convolution.
//
// Two batch rows of one head go through one complex FFT, z = s1 v1 + i s2 v2 (v = pregate ⊙ u, s a power of two
// per row that brings its largest value into (0.5, 1]): the filter is real, so the inverse transform of Z ⊙ K
// holds both convolutions, one in each part. z lives in shared memory as float16 real and imaginary planes.
// N = r 16^a: one radix-r pass on the CUDA cores with the loads (decimation in frequency), radix-16 passes as
// mma.m16n8k16 products with the DFT-16 / 4 (the last two of the forward, the product with the filter's spectrum
// and the first two of the inverse on one 256-point block a warp, in registers: movmatrix transposes between
// them), the inverse passes in reverse order (decimation in time: the spectrum stays in digit-reversed order, the
// filter's is gathered into that order), and the inverse radix-r pass with the epilogue. Every pass is unitary,
// so values stay within float16's range; float32 in registers. Its passes: fftconv_tc_block.cuh; the filter's
// gradient on the same passes: fftconv_tc_filter_grad.cu.
// float16 operands hold bfloat16 rows to PyTorch's error (the model: 1.01-1.17x); float16 rows would not
// (3-5x), so they, float32 rows and other lengths keep the block kernels.
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

template <int N>
__global__ void __launch_bounds__(kThreads, tc_min_blocks<N>()) tc_forward_kernel(const TcParams p) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = TcShape<N>;
  using Block = TcBlock<N>;
  using Pass = Simt<N>;
  constexpr int kM = N / 2;
  extern __shared__ __align__(16) unsigned char smem[];
  const int h = blockIdx.x / p.chunks, chunk = blockIdx.x % p.chunks;
  const int pairs = (p.B + 1) / 2;
  const int per_chunk = (pairs + p.chunks - 1) / p.chunks;
  const int first = chunk * per_chunk, last = min(pairs, first + per_chunk);
  const int pipe = threadIdx.x / kPipeThreads;

  float2* tables = reinterpret_cast<float2*>(smem + Shape::kTablesOffset);
  float* scratch = reinterpret_cast<float*>(smem + Shape::kScratchOffset);
  Block blk = Block::place(smem, pipe, tables, scratch);
  blk.spectrum = reinterpret_cast<uint32_t*>(smem + Shape::kSpectrumOffset);
  float* block_scratch = scratch + kPipes * kPipeWarps * 2;
  const int L = p.L;
  auto row_of = [&](int b) { return ((int64_t)b * p.H + h) * L; };
  // rows b and b + 1 (the same row again where there is no b + 1) of this head into L2, one loop over both: a
  // pair's rows lie H rows apart
  auto prefetch_pair = [&](const __nv_bfloat16* base, int b) {
    if (base == nullptr) return;
    const __nv_bfloat16* r1 = base + row_of(b);
    const __nv_bfloat16* r2 = b + 1 < p.B ? r1 + (int64_t)p.H * L : r1;
    for (int i = blk.tid * 64; i < 2 * L; i += kPipeThreads * 64) prefetch_l2(i < L ? r1 + i : r2 + (i - L));
  };
  if (first + pipe < last) {  // this pipeline's first pair into L2 while the spectrum is gathered
    prefetch_pair(p.u, 2 * (first + pipe));
    prefetch_pair(p.pregate, 2 * (first + pipe));
  }

  // twiddle tables and the head's spectrum, scaled into float16, in the block pass's fragment order
  Block::build_twiddles(tables);
  // the head's spectrum S + D (D v as a tap at lag 0), staged in rfft's order in the pipelines' planes (free until
  // the first pair), then each thread's four fragment slots gathered from there: frequency f of the block pass's
  // position, conj(S[N - f]) above M. The staging XOR-swizzles bits 0-3 of f with the bits the lanes of one gather
  // differ in (the model's search: no bank conflict in either step).
  const float2* S = p.S + (int64_t)h * (kM + 1);
  const float D = p.D ? p.D[h] : 0.f;
  float2* staged = reinterpret_cast<float2*>(smem);
  constexpr int kLog = (Shape::kR == 1 ? 0 : Shape::kR == 2 ? 1 : Shape::kR == 4 ? 2 : 3) + 4 * (Shape::kA - 2) + 4;
  auto stage = [](int f) { return f ^ (((f >> kLog) & 7) | (((f >> (kLog + 5)) & 1) << 3)); };
  constexpr int kPerThread = (kM + 1 + kThreads - 1) / kThreads;
  float m = 0.f;
#pragma unroll
  for (int i = 0; i < kPerThread; ++i) {
    const int f = threadIdx.x + i * kThreads;
    if (f <= kM) {
      const float2 v = make_float2(S[f].x + D, S[f].y);
      m = fmaxf(m, fmaxf(fabsf(v.x), fabsf(v.y)));
      staged[stage(f)] = v;
    }
  }
#pragma unroll
  for (int o = 16; o > 0; o >>= 1) m = fmaxf(m, __shfl_xor_sync(0xffffffffu, m, o));
  if ((threadIdx.x & 31) == 0) block_scratch[threadIdx.x >> 5] = m;
  __syncthreads();
  m = 0.f;
  for (int i = 0; i < kThreads / 32; ++i) m = fmaxf(m, block_scratch[i]);
  const float sk = unit_scale(m);
  for (int g = threadIdx.x; g < N / 4; g += kThreads) {  // uint4 g: tile, n-tile, lane
    const int lane = g & 31, vh = (g >> 5) & 1, tile = g >> 6;
    float2 k[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const int row = c_row(lane, e), col = c_col(lane, vh, e);
      const int f = Block::frequency(16 * (16 * tile + row) + col);
      const float2 v = staged[stage(f <= kM ? f : N - f)];
      k[e] = make_float2(v.x * sk, (f > kM) != p.correlate ? -v.y * sk : v.y * sk);  // conj above M; correlate: conj
    }
    // the block pass's pairs: real parts of elements 0 and 1, their imaginary parts, then elements 2 and 3
    reinterpret_cast<uint4*>(blk.spectrum)[g] = make_uint4(pack_half2(k[0].x, k[1].x), pack_half2(k[0].y, k[1].y),
                                                           pack_half2(k[2].x, k[3].x), pack_half2(k[2].y, k[3].y));
  }
  __syncthreads();

  const Dft16 dft(blk.lane);
  for (int pair = first + pipe; pair < last; pair += kPipes) {
    const int b1 = 2 * pair;
    const bool two = b1 + 1 < p.B;
    const int64_t row1 = row_of(b1), row2 = row_of(b1 + 1);
    float s1, s2;
    Pass::forward(p, row1, row2, two, blk.re, blk.im, blk.tid, [&](float2 m) { return blk.pipe_max(m, pipe); }, s1,
                  s2);
    pipe_sync(pipe);
    // the postgate's rows the epilogue reads, and the next pair's inputs, into L2 while the tensor cores work
    prefetch_pair(p.postgate, b1);
    if (pair + kPipes < last) {
      prefetch_pair(p.u, b1 + 2 * kPipes);
      prefetch_pair(p.pregate, b1 + 2 * kPipes);
    }
    blk.template spectral_passes<Product::kFilter>(dft, pipe);
    Pass::inverse(p, row1, row2, two, 1.f / (s1 * sk), 1.f / (s2 * sk), blk.re, blk.im, blk.tid);
    pipe_sync(pipe);  // the next pair's first pass overwrites the planes
  }
#endif
}

template <int N>
cudaError_t launch_tc(const TcForwardArgs& a, int num_sms, cudaStream_t stream) {
  constexpr int kSmem = TcShape<N>::kSmemBytes;
  auto kernel = tc_forward_kernel<N>;
  const int resident = resident_blocks(kernel, kThreads, kSmem);
  if (resident == 0) return cudaErrorInvalidConfiguration;
  const int chunks = pair_chunks(a.B, a.H, resident, num_sms);
  const bool vec = rows_vectorizable(a.L, {a.u, a.pregate, a.postgate, a.y});
  const TcParams p{static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate),
                   static_cast<const __nv_bfloat16*>(a.postgate), a.S, a.D, static_cast<__nv_bfloat16*>(a.y),
                   a.B, a.H, a.L, chunks, a.gelu, vec, a.correlate};
  kernel<<<(unsigned)(a.H * chunks), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

bool tc_forward_takes(Dtype dtype, int M, int cc_major, int smem_optin) {
  if (dtype != Dtype::kBFloat16 || cc_major < 9) return false;
  return with_tc_length(M, false, [&](auto n) { return TcShape<decltype(n)::value>::kSmemBytes <= smem_optin; });
}

cudaError_t launch_tc_forward(int M, const TcForwardArgs& args, int num_sms, cudaStream_t stream) {
  return with_tc_length(M, cudaErrorInvalidValue,
                        [&](auto n) { return launch_tc<decltype(n)::value>(args, num_sms, stream); });
}

}  // namespace fftconv
}  // namespace bem
