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
// so values stay within float16's range; float32 in registers.
// float16 operands hold bfloat16 rows to PyTorch's error (the model: 1.01-1.17x); float16 rows would not
// (3-5x), so they, float32 rows and other lengths keep the block kernels.
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>

#include "fftconv.h"
#include "fftconv_block.cuh"
#include "fftconv_launch.cuh"
#include "fftconv_tc_fragments.cuh"
#include "fftconv_tc_plan.cuh"
#include "fftconv_tc_rows.cuh"

namespace bem {
namespace fftconv {
namespace {

using namespace tc;  // fftconv_tc_fragments.cuh, fftconv_tc_plan.cuh, fftconv_tc_rows.cuh

// What the block pass multiplies the spectrum by: the filter's; nothing (it keeps the spectrum); the kept one
// (times this one's conjugate)
enum class Product { kFilter, kStore, kConjugateStored };

template <int N>
struct TcBlock {
  using Shape = TcShape<N>;
  static constexpr int kA = Shape::kA, kR = Shape::kR, kS0 = Shape::kS0, kTiles = Shape::kTiles;

  __half* re;
  __half* im;
  uint32_t* spectrum;  // the block pass's fragment order: [tile][n-tile][lane] x 4 float16 pairs (re, im)
  const float2* w256;  // W_256^m, m < 256
  const float2* w4096; // W_4096^m, m < 256
  float* scratch;      // this pipeline's partial maxima
  int lane, warp, tid;

  // the frequency the forward passes leave at position p = q0 s0 + d1 16^(a-1) + ... + da: f = q0 + r (d1 + 16 d2
  // [+ 256 d3])
  static __device__ int frequency(int p) {
    const int q0 = p / kS0, rest = p % kS0;
    if (kA == 3) return q0 + kR * ((rest >> 8) + 16 * ((rest >> 4) & 15) + 256 * (rest & 15));
    return q0 + kR * ((rest >> 4) + 16 * (rest & 15));
  }

  template <int kN>
  __device__ uint32_t strided_addr(int tile) const {
    constexpr int s = kN / 16, per_block = s / 16;
    const int b = tile / per_block, j1 = tile % per_block;
    const int m = lane >> 3, i = lane & 7;
    return smem_address(re + swz(b * kN + 16 * j1 + 8 * (m & 1) + (i + 8 * (m >> 1)) * s));
  }
  static constexpr uint32_t kImOffset = 2 * N;  // bytes from the real plane to the imaginary one

  // this lane's W_n^{±row col} (n = 256 or 4096: row col <= 225 stays inside the tables), per (n-tile, element)
  __device__ void lane_twiddles(const float2* table, bool conjugate, float2 (&tw)[2][4]) const {
#pragma unroll
    for (int nt = 0; nt < 2; ++nt)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const float2 w = table[c_row(lane, e) * c_col(lane, nt, e)];
        tw[nt][e] = conjugate ? conj2(w) : w;
      }
  }

  // W_256^{factor col} for this lane's four columns (c_col's order: n-tile, then element & 1)
  __device__ void column_twiddles(int factor, float2 (&out)[4]) const {
#pragma unroll
    for (int i = 0; i < 4; ++i) out[i] = w256[(factor * c_col(lane, i >> 1, i & 1)) & 255];
  }

  // The radix-16 pass over blocks of 4096 points (stride 256): forward, with its output twiddles
  // W_4096^{(16 j1 + row) col} = W_4096^{row col} W_256^{j1 col} (the second factor per column), or inverse.
  template <bool kInverse>
  __device__ void outer_pass(const Dft16& w) const {
    float2 tw[2][4];
    if (!kInverse) lane_twiddles(w4096, false, tw);
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = strided_addr<4096>(tile), a_im = a_re + kImOffset;
      uint32_t ar[4], ai[4];
      load_tile(a_re, ar);
      load_tile(a_im, ai);
      float cr[2][4], ci[2][4];
      dft_tile<kInverse>(ar, ai, w, cr, ci);
      if (!kInverse) {
        float2 col_tw[4];
        column_twiddles(tile & 15, col_tw);
        twiddle_tile(cr, ci, lane, [&](int nt, int e) { return cmul(tw[nt][e], col_tw[(e & 1) + 2 * nt]); });
      }
      store_tile(a_re, cr, ci);
    }
  }

  __device__ static void store_tile(uint32_t a_re, const float (&cr)[2][4], const float (&ci)[2][4]) {
    uint32_t r[4];
    pack_tile(cr, r);
    store_tile_trans(a_re, r);
    pack_tile(ci, r);
    store_tile_trans(a_re + kImOffset, r);
  }

  // One 256-point block a tile, in registers from its load to its store: the forward radix-16 pass of stride 16
  // (its twiddles W_256^{jq}), the last forward pass on the block's 16 groups (C transposed into the next A by
  // movmatrix), the product with the spectrum, the first inverse pass, its twiddles for the inverse pass of
  // stride 16, that pass (transposed again) and, with a pass of 4096 after it, that pass's input twiddles
  // W_4096^{-(row + 16 col) qb} = conj(W_4096^{row qb} W_256^{col qb}), qb = the block's index mod 16.
  // kStore keeps the forward's spectrum in `spectrum` (the table's order) and stops there; kConjugateStored
  // multiplies the conjugate of this transform's spectrum by the kept one instead of by the filter's.
  template <Product kMode>
  __device__ void block_pass(const Dft16& w) const {
    float2 tw[2][4];
    lane_twiddles(w256, false, tw);
    uint32_t twr[4], twi[4], conj_twi[4];
    pair_twiddles(tw, twr, twi);
#pragma unroll
    for (int i = 0; i < 4; ++i) conj_twi[i] = twi[i] ^ 0x80008000u;
    for (int tile = warp; tile < kTiles; tile += kPipeWarps) {
      const uint32_t a_re = strided_addr<256>(tile), a_im = a_re + kImOffset;
      uint4 k0 = make_uint4(0, 0, 0, 0), k1 = k0;
      if (kMode != Product::kStore) {
        k0 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2) * 32 + lane];
        k1 = reinterpret_cast<const uint4*>(spectrum)[(tile * 2 + 1) * 32 + lane];
      }
      uint32_t ar[4], ai[4];
      load_tile(a_re, ar);
      load_tile(a_im, ai);
      float cr[2][4], ci[2][4];
      dft_tile<false>(ar, ai, w, cr, ci);
      twiddled_transpose(cr, ci, twr, twi, ar, ai);
      dft_tile<false>(ar, ai, w, cr, ci);
      pack_tile(cr, ar);
      pack_tile(ci, ai);
      if (kMode == Product::kStore) {
        reinterpret_cast<uint4*>(spectrum)[(tile * 2) * 32 + lane] = make_uint4(ar[0], ai[0], ar[1], ai[1]);
        reinterpret_cast<uint4*>(spectrum)[(tile * 2 + 1) * 32 + lane] = make_uint4(ar[2], ai[2], ar[3], ai[3]);
        continue;
      }
      if (kMode == Product::kConjugateStored) {
#pragma unroll
        for (int i = 0; i < 4; ++i) ai[i] ^= 0x80008000u;
      }
      const uint32_t kr[4] = {k0.x, k0.z, k1.x, k1.z}, ki[4] = {k0.y, k0.w, k1.y, k1.w};
      twiddle_pairs(ar, ai, kr, ki);
      dft_tile<true>(ar, ai, w, cr, ci);
      twiddled_transpose(cr, ci, twr, conj_twi, ar, ai);
      dft_tile<true>(ar, ai, w, cr, ci);
      if (kA == 3) {
        const int qb = tile & 15;
        const float2 row_tw[2] = {w4096[(lane >> 2) * qb], w4096[((lane >> 2) + 8) * qb]};
        float2 col_tw[4];
        column_twiddles(qb, col_tw);
        twiddle_tile(cr, ci, lane,
                     [&](int nt, int e) { return conj2(cmul(row_tw[e >> 1], col_tw[(e & 1) + 2 * nt])); });
      }
      store_tile(a_re, cr, ci);
    }
  }

  // The passes between the CUDA-core ones: the outer forward pass (N = r 4096), the block pass, and, unless it
  // keeps the spectrum (kStore), the outer inverse pass; each followed by the pipeline's barrier.
  template <Product kMode>
  __device__ void spectral_passes(const Dft16& w, int pipe) const {
    if (kA == 3) {
      outer_pass<false>(w);
      pipe_sync(pipe);
    }
    block_pass<kMode>(w);
    pipe_sync(pipe);
    if (kMode != Product::kStore && kA == 3) {
      outer_pass<true>(w);
      pipe_sync(pipe);
    }
  }

  // the pipeline's largest |value| of two rows, each reduced over its 8 warps
  __device__ float2 pipe_max(float2 m, int pipe) const {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
      m.x = fmaxf(m.x, __shfl_xor_sync(0xffffffffu, m.x, o));
      m.y = fmaxf(m.y, __shfl_xor_sync(0xffffffffu, m.y, o));
    }
    if (lane == 0) {
      scratch[2 * warp] = m.x;
      scratch[2 * warp + 1] = m.y;
    }
    pipe_sync(pipe);
    float2 out = make_float2(0.f, 0.f);
#pragma unroll
    for (int i = 0; i < kPipeWarps; ++i) {
      out.x = fmaxf(out.x, scratch[2 * i]);
      out.y = fmaxf(out.y, scratch[2 * i + 1]);
    }
    return out;
  }
};

template <int N>
__global__ void __launch_bounds__(kThreads, 1) tc_forward_kernel(const TcParams p) {
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

  Block blk;
  blk.re = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes);
  blk.im = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes + Shape::kPlaneBytes);
  blk.spectrum = reinterpret_cast<uint32_t*>(smem + Shape::kSpectrumOffset);
  float2* w256 = reinterpret_cast<float2*>(smem + Shape::kTablesOffset);
  float2* w4096 = w256 + 256;
  blk.w256 = w256;
  blk.w4096 = w4096;
  float* scratch = reinterpret_cast<float*>(smem + Shape::kScratchOffset);
  blk.scratch = scratch + pipe * kPipeWarps * 2;
  blk.tid = threadIdx.x % kPipeThreads;
  blk.lane = threadIdx.x & 31;
  blk.warp = blk.tid >> 5;
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
  {
    const int t = threadIdx.x & 255;
    float s, c;
    sincospif((float)t / (threadIdx.x < 256 ? 128.f : 2048.f), &s, &c);
    (threadIdx.x < 256 ? w256 : w4096)[t] = make_float2(c, -s);
  }
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
__global__ void __launch_bounds__(kThreads, 1) tc_filter_grad_kernel(const GradParams q) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  using Shape = TcShape<N>;
  using Block = TcBlock<N>;
  using Pass = Simt<N>;
  extern __shared__ __align__(16) unsigned char smem[];
  const int pairs = (q.B + 1) / 2;
  const int per_chunk = (pairs + q.chunks - 1) / q.chunks;
  const int pipe = threadIdx.x / kPipeThreads;

  Block blk;
  blk.re = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes);
  blk.im = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes + Shape::kPlaneBytes);
  blk.spectrum = GradShape<N>::kGlobalTable ? q.table + ((int64_t)blockIdx.x * kPipes + pipe) * N
                                            : reinterpret_cast<uint32_t*>(smem + Shape::kSpectrumOffset + pipe * 4 * N);
  float2* w256 = reinterpret_cast<float2*>(smem + GradShape<N>::kTwiddleOffset);
  float2* w4096 = w256 + 256;
  blk.w256 = w256;
  blk.w4096 = w4096;
  blk.scratch = reinterpret_cast<float*>(smem + GradShape<N>::kScratchOffset) + pipe * kPipeWarps * 2;
  blk.tid = threadIdx.x % kPipeThreads;
  blk.lane = threadIdx.x & 31;
  blk.warp = blk.tid >> 5;
  {
    const int t = threadIdx.x & 255;
    float s, c;
    sincospif((float)t / (threadIdx.x < 256 ? 128.f : 2048.f), &s, &c);
    (threadIdx.x < 256 ? w256 : w4096)[t] = make_float2(c, -s);
  }
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
    Pass::template forward<true>(rows(q.dy, q.postgate), row1, row2, two, blk.re, blk.im, blk.tid, reduce, sg, unused);
    pipe_sync(pipe);
    // v's rows into L2 while the tensor cores work (the forward kernel's prefetch; without it, the passes' loads
    // from DRAM were the kernel's largest stall)
    for (int r = 0; r < (two ? 2 : 1); ++r) {
      prefetch_row_l2(q.u + (r == 0 ? row1 : row2), q.L, blk.tid, kPipeThreads);
      if (q.pregate) prefetch_row_l2(q.pregate + (r == 0 ? row1 : row2), q.L, blk.tid, kPipeThreads);
    }
    blk.template spectral_passes<Product::kStore>(dft, pipe);
    Pass::template forward<true>(rows(q.u, q.pregate), row1, row2, two, blk.re, blk.im, blk.tid, reduce, sv, unused);
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

// chunks of a head's pairs and blocks: one chunk a head unless the heads alone would not fill the GPU
template <int N>
TcFilterGradPlan filter_grad_plan(int B, int H, int num_sms) {
  TcFilterGradPlan plan;
  const int resident = resident_blocks(tc_filter_grad_kernel<N>, kThreads, GradShape<N>::kSmemBytes);
  if (resident == 0 || H == 0) return plan;
  const int pairs = (B + 1) / 2;
  const int64_t full = (int64_t)resident * num_sms;
  const int64_t wanted = (full + H - 1) / H;
  plan.chunks = (int)std::max<int64_t>(1, std::min<int64_t>((pairs + kPipes - 1) / kPipes, wanted));
  plan.grid = (int)std::min<int64_t>((int64_t)H * plan.chunks, full);
  plan.table_words = GradShape<N>::kGlobalTable ? (int64_t)plan.grid * kPipes * N : 0;
  plan.dD_words = (int64_t)H * pairs * kPipeWarps;
  return plan;
}

template <int N>
cudaError_t launch_filter_grad(const TcFilterGradArgs& a, const TcFilterGradPlan& plan, cudaStream_t stream) {
  if (plan.grid <= 0 || (GradShape<N>::kGlobalTable && a.table == nullptr) ||
      (a.dk == nullptr) == (a.dk_part == nullptr) || (a.dk != nullptr && plan.chunks != 1))
    return cudaErrorInvalidValue;
  auto aligned = [](const void* p) { return p == nullptr || reinterpret_cast<uintptr_t>(p) % 16 == 0; };
  const bool vec = a.L % 8 == 0 && aligned(a.dy) && aligned(a.postgate) && aligned(a.u) && aligned(a.pregate);
  const GradParams q{static_cast<const __nv_bfloat16*>(a.dy), static_cast<const __nv_bfloat16*>(a.postgate),
                     static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate), a.dk,
                     a.dk_part, a.dD_part, a.table, a.B, a.H, a.L, a.Lk, a.taps, plan.chunks, a.dk_dtype, vec};
  tc_filter_grad_kernel<N><<<(unsigned)plan.grid, kThreads, GradShape<N>::kSmemBytes, stream>>>(q);
  return cudaGetLastError();
}

template <int N>
cudaError_t launch_tc(const TcForwardArgs& a, int num_sms, cudaStream_t stream) {
  constexpr int kSmem = TcShape<N>::kSmemBytes;
  auto kernel = tc_forward_kernel<N>;
  const int resident = resident_blocks(kernel, kThreads, kSmem);
  if (resident == 0) return cudaErrorInvalidConfiguration;
  // a block per head and chunk of its row pairs: chunks only where the heads alone would not fill the GPU
  const int pairs = (a.B + 1) / 2;
  const int64_t wanted = ((int64_t)resident * num_sms + a.H - 1) / a.H;
  const int chunks = (int)std::max<int64_t>(1, std::min<int64_t>((pairs + kPipes - 1) / kPipes, wanted));
  auto aligned = [](const void* q) { return q == nullptr || reinterpret_cast<uintptr_t>(q) % 16 == 0; };
  const bool vec = a.L % 8 == 0 && aligned(a.u) && aligned(a.pregate) && aligned(a.postgate) && aligned(a.y);
  const TcParams p{static_cast<const __nv_bfloat16*>(a.u), static_cast<const __nv_bfloat16*>(a.pregate),
                   static_cast<const __nv_bfloat16*>(a.postgate), a.S, a.D, static_cast<__nv_bfloat16*>(a.y),
                   a.B, a.H, a.L, chunks, a.gelu, vec, a.correlate};
  kernel<<<(unsigned)(a.H * chunks), kThreads, kSmem, stream>>>(p);
  return cudaGetLastError();
}

// The tensor-core forward's spectrum lengths, 1024 .. 8192 (a complex FFT of N = 2M): f(N), or `otherwise`
template <typename F, typename R>
R with_tc_length(int M, R otherwise, F&& f) {
  R out = otherwise;
  with_spectrum_length(M, [&](auto m) {
    constexpr int kM = decltype(m)::value;
    if constexpr (kM <= 8192) out = f(std::integral_constant<int, 2 * kM>());
    return cudaSuccess;
  });
  return out;
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
