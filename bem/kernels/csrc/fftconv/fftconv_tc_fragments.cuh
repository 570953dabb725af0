// The warp-level pieces of the tensor-core fftconv forward (fftconv_tc.cu), on common.cuh's ldmatrix and
// mma.m16n8k16: a tile's load and its transposed store, movmatrix, the DFT-16 as B operands, a 16 x 16 complex
// tile times it, twiddles on a tile in float32 or in float16 pairs. Fragment layouts as the PTX manual gives them; scripts/fftconv_tc_model.py
// models each one.
#pragma once

#include <cuda_fp16.h>

#include <cstdint>

#include "../common/common.cuh"
#include "fftconv_block.cuh"

namespace bem {
namespace fftconv {
namespace tc {

// A 16 x 16 tile of a float16 plane into registers: ldmatrix.x4.trans (common.cuh) with each lane's row address, the
// four 8 x 8 blocks as an A fragment
__device__ __forceinline__ void load_tile(unsigned address, uint32_t (&r)[4]) {
  const uint4 v = ldmatrix_x4_trans(address);
  r[0] = v.x;
  r[1] = v.y;
  r[2] = v.z;
  r[3] = v.w;
}

// Its inverse: the four blocks of a packed tile back to the same rows, transposed (stmatrix, sm_90)
__device__ __forceinline__ void store_tile_trans(unsigned address, const uint32_t (&r)[4]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("stmatrix.sync.aligned.m8n8.x4.trans.shared.b16 [%0], {%1,%2,%3,%4};"
               :: "r"(address), "r"(r[0]), "r"(r[1]), "r"(r[2]), "r"(r[3]) : "memory");
#endif
}

__device__ __forceinline__ uint32_t pack_half2(float lo, float hi) {
  const __half2 h = __floats2half2_rn(lo, hi);
  return *reinterpret_cast<const uint32_t*>(&h);
}

// The DFT-16 / 4 as mma B fragments (k = input index, n = output index), n-tiles 0 and 1: real part,
// imaginary part and its negation.
struct Dft16 {
  uint32_t re[2][2], im[2][2], neg_im[2][2];
  __device__ explicit Dft16(int lane) {
    const int n = lane >> 2, k = (lane & 3) * 2;
#pragma unroll
    for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
      for (int half = 0; half < 2; ++half) {
        float c[2], s[2];
#pragma unroll
        for (int e = 0; e < 2; ++e) sincospif((float)(((k + 8 * half + e) * (n + 8 * nt)) & 15) / 8.f, &s[e], &c[e]);
        re[nt][half] = pack_half2(0.25f * c[0], 0.25f * c[1]);
        im[nt][half] = pack_half2(-0.25f * s[0], -0.25f * s[1]);
        neg_im[nt][half] = pack_half2(0.25f * s[0], 0.25f * s[1]);
      }
    }
  }
};

// One warp's 16 x 16 tile times the DFT-16: rows of A (real and imaginary parts), C in float32 (n-tiles 0 and 1);
// the inverse multiplies by the conjugate.
template <bool kInverse>
__device__ __forceinline__ void dft_tile(const uint32_t (&ar)[4], const uint32_t (&ai)[4], const Dft16& w,
                                         float (&cr)[2][4], float (&ci)[2][4]) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) cr[nt][e] = ci[nt][e] = 0.f;
    const uint32_t(&bi)[2] = kInverse ? w.im[nt] : w.neg_im[nt];
    const uint32_t(&bn)[2] = kInverse ? w.neg_im[nt] : w.im[nt];
    mma_16816<__half>(cr[nt], ar[0], ar[1], ar[2], ar[3], w.re[nt][0], w.re[nt][1]);
    mma_16816<__half>(cr[nt], ai[0], ai[1], ai[2], ai[3], bi[0], bi[1]);
    mma_16816<__half>(ci[nt], ar[0], ar[1], ar[2], ar[3], bn[0], bn[1]);
    mma_16816<__half>(ci[nt], ai[0], ai[1], ai[2], ai[3], w.re[nt][0], w.re[nt][1]);
  }
}

// The (row, column) of C element e of n-tile nt that this lane holds
__device__ __forceinline__ int c_row(int lane, int e) { return (lane >> 2) + 8 * (e >> 1); }
__device__ __forceinline__ int c_col(int lane, int nt, int e) { return (lane & 3) * 2 + (e & 1) + 8 * nt; }

// multiplies C element (nt, e) by tw(nt, e)
template <typename Twiddle>
__device__ __forceinline__ void twiddle_tile(float (&cr)[2][4], float (&ci)[2][4], int lane, Twiddle&& tw) {
#pragma unroll
  for (int nt = 0; nt < 2; ++nt) {
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      const float2 z = cmul(make_float2(cr[nt][e], ci[nt][e]), tw(nt, e));
      cr[nt][e] = z.x;
      ci[nt][e] = z.y;
    }
  }
}

// C as four float16 pairs: (n-tile 0, rows g), (0, g + 8), (1, g), (1, g + 8) — the stmatrix registers, and
// also the A fragment of the same 16 x 16 values with k = column.
__device__ __forceinline__ void pack_tile(const float (&c)[2][4], uint32_t (&r)[4]) {
  r[0] = pack_half2(c[0][0], c[0][1]);
  r[1] = pack_half2(c[0][2], c[0][3]);
  r[2] = pack_half2(c[1][0], c[1][1]);
  r[3] = pack_half2(c[1][2], c[1][3]);
}

__device__ __forceinline__ uint32_t movmatrix_trans(uint32_t a) {
  uint32_t d;
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(d) : "r"(a));
  return d;
}

// The A fragment of the transpose of a tile packed by pack_tile (rows = its columns, k = its rows): the four 8 x 8
// blocks, each transposed in registers, the two off the diagonal trading places.
__device__ __forceinline__ void transposed_a(const uint32_t (&r)[4], uint32_t (&a)[4]) {
  a[0] = movmatrix_trans(r[0]);
  a[1] = movmatrix_trans(r[2]);
  a[2] = movmatrix_trans(r[1]);
  a[3] = movmatrix_trans(r[3]);
}

__device__ __forceinline__ __half2 as_half2(uint32_t v) { return *reinterpret_cast<const __half2*>(&v); }
__device__ __forceinline__ uint32_t as_u32(__half2 v) { return *reinterpret_cast<const uint32_t*>(&v); }

// A packed tile (pack_tile's pairs of real parts pr and imaginary parts pi) times twiddles paired the same way, in
// float16 arithmetic: two complex products for four instructions (the model, with the block pass's twiddles so:
// 1.01-1.17x PyTorch's error; 1.04-1.11x with them in float32).
__device__ __forceinline__ void twiddle_pairs(uint32_t (&pr)[4], uint32_t (&pi)[4], const uint32_t (&wr)[4],
                                              const uint32_t (&wi)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const __half2 a = as_half2(pr[i]), b = as_half2(pi[i]);
    pr[i] = as_u32(__hfma2(a, as_half2(wr[i]), __hneg2(__hmul2(b, as_half2(wi[i])))));
    pi[i] = as_u32(__hfma2(a, as_half2(wi[i]), __hmul2(b, as_half2(wr[i]))));
  }
}

// float32 twiddles per (n-tile, element) as pack_tile's pairs
__device__ __forceinline__ void pair_twiddles(const float2 (&tw)[2][4], uint32_t (&wr)[4], uint32_t (&wi)[4]) {
#pragma unroll
  for (int i = 0; i < 4; ++i) {
    const float2 a = tw[i >> 1][2 * (i & 1)], b = tw[i >> 1][2 * (i & 1) + 1];
    wr[i] = pack_half2(a.x, b.x);
    wi[i] = pack_half2(a.y, b.y);
  }
}

// C (float32) times twiddles paired as pack_tile's (float16), transposed into the A fragment of the next pass
__device__ __forceinline__ void twiddled_transpose(const float (&cr)[2][4], const float (&ci)[2][4],
                                                   const uint32_t (&wr)[4], const uint32_t (&wi)[4], uint32_t (&ar)[4],
                                                   uint32_t (&ai)[4]) {
  uint32_t pr[4], pi[4];
  pack_tile(cr, pr);
  pack_tile(ci, pi);
  twiddle_pairs(pr, pi, wr, wi);
  transposed_a(pr, ar);
  transposed_a(pi, ai);
}


}  // namespace tc
}  // namespace fftconv
}  // namespace bem
