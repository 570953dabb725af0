// The tensor-core fftconv kernels' passes on the float16 planes (fftconv_tc.cu, fftconv_tc_filter_grad.cu): a
// pipeline's TcBlock (the radix-16 passes as mma.m16n8k16 products, the block pass on one 256-point block a warp in
// registers, the pipeline's maxima), the kernels' spectrum lengths, and what their launches share (the chunks of a
// head's row pairs, the rows' 16-byte accesses).
#pragma once

#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <algorithm>
#include <cstdint>
#include <initializer_list>
#include <type_traits>

#include "fftconv_block.cuh"
#include "fftconv_launch.cuh"
#include "fftconv_tc_fragments.cuh"
#include "fftconv_tc_plan.cuh"

namespace bem {
namespace fftconv {
namespace tc {

// Two blocks a multiprocessor at N = 2048, at 64 registers (ptxas spills 32 bytes in the forward and 8 in the
// filter gradient; at 4096 it would spill hundreds). Its passes are short and latency-bound, and with one block a
// multiprocessor only the other pipeline hides them: on an H100 at L 1K the forward took 56 -> 50 us, the forward
// and backward 217 -> 191 us.
template <int N>
constexpr int tc_min_blocks() { return N <= 2048 ? 2 : 1; }

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

  // this thread's pipeline `pipe` of a block: its planes at `smem` (each pipeline's real plane, then its imaginary
  // one), the twiddle tables (W_256, then W_4096) and its pipeline's maxima in `scratch`; the caller sets
  // `spectrum` (where it lives differs by kernel)
  static __device__ TcBlock place(unsigned char* smem, int pipe, float2* tables, float* scratch) {
    TcBlock blk;
    blk.re = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes);
    blk.im = reinterpret_cast<__half*>(smem + pipe * 2 * Shape::kPlaneBytes + Shape::kPlaneBytes);
    blk.w256 = tables;
    blk.w4096 = tables + 256;
    blk.scratch = scratch + pipe * kPipeWarps * 2;
    blk.tid = threadIdx.x % kPipeThreads;
    blk.lane = threadIdx.x & 31;
    blk.warp = blk.tid >> 5;
    return blk;
  }

  // the twiddle tables w256 and w4096 point to (W_256 then W_4096 at `tables`, 256 each), written by the block's
  // first 512 threads (the caller syncs)
  static __device__ void build_twiddles(float2* tables) {
    const int t = threadIdx.x & 255;
    float s, c;
    sincospif((float)t / (threadIdx.x < 256 ? 128.f : 2048.f), &s, &c);
    (threadIdx.x < 256 ? tables : tables + 256)[t] = make_float2(c, -s);
  }

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

// The tensor-core kernels' spectrum lengths, 1024 .. 8192 (a complex FFT of N = 2M): f(N), or `otherwise`
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

// A block per head and chunk of its row pairs: chunks only where the heads alone would not fill the GPU's
// resident blocks (each chunk at least one pair a pipeline)
inline int pair_chunks(int B, int H, int resident, int num_sms) {
  const int pairs = (B + 1) / 2;
  const int64_t wanted = ((int64_t)resident * num_sms + H - 1) / H;
  return (int)std::max<int64_t>(1, std::min<int64_t>((pairs + kPipes - 1) / kPipes, wanted));
}

// The rows' 16-byte accesses: L a multiple of 8 and every row pointer 16-byte aligned (null ones are not read)
inline bool rows_vectorizable(int L, std::initializer_list<const void*> rows) {
  return L % 8 == 0 && std::all_of(rows.begin(), rows.end(),
                                   [](const void* p) { return reinterpret_cast<uintptr_t>(p) % 16 == 0; });
}

}  // namespace tc
}  // namespace fftconv
}  // namespace bem
