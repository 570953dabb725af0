// Host-side entry points of the fftconv kernels, in plain CUDA types (the torch bindings live in
// fftconv_bindings.cpp). One flat argument struct per kernel.
//
// Spectrum length M = max(1024, next power of two >= L): the convolution runs as real FFTs of size 2M.
// S, the filter's spectrum, is complex (H, M + 1): S = rfft(k[:, :L], n = 2M). D ⊙ v is added directly.
// Up to M = 16384 (L <= 16384) one thread block transforms one row in shared memory (fftconv_block.cuh);
// above, up to M = 2^20, forward and backward run as a four-step FFT of three passes (fftconv_tiled.cu), whose
// spectrum S is in that order; above 2^20 cuFFT's transforms with the element-wise kernels of fftconv_long.cu
// (whose activation pass and dD sums the four-step backward uses too).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "fftconv_pass.h"

namespace bem {
namespace fftconv {

enum class Dtype { kHalf, kBFloat16, kFloat };

constexpr int kMinSpectrum = 1024;
constexpr int kMaxBlockSpectrum = 16384;
constexpr int kTiledRowLength = 8192;             // M2 of the four-step form
constexpr int kMaxTiledSpectrum = 1 << 20;        // M1 = M / M2 <= 128

inline int64_t spectrum_length(int64_t L) {
  int64_t M = kMinSpectrum;
  while (M < L) M *= 2;
  return M;
}

// S[h] = rfft(k[h, :taps], n = 2M); k: (H, Lk) row-major of `dtype` (read as it is, in float32 arithmetic),
// taps = min(Lk, L).
struct SpectrumArgs {
  const void* k;
  Dtype dtype;
  float2* S;  // (H, M + 1)
  int H, Lk, taps;
};

// y = postgate ⊙ act(conv(pregate ⊙ u, k) + D ⊙ pregate ⊙ u) per row (B * H rows of L); gates may be null.
struct ForwardArgs {
  const void* u;
  const void* pregate;
  const void* postgate;
  const float2* S;
  const float* D;  // float32 (H,) or null
  void* y;
  int64_t rows;
  int H, L;
  bool gelu;
};

// The tensor-core forward (fftconv_tc.cu): bfloat16 rows, 1024 <= M <= 8192, compute capability 9.0 and
// later; the same operands as ForwardArgs, with B and H given apart (two batch rows of a head share a transform).
// With `correlate`, the filter's spectrum is conjugated: y = postgate ⊙ act(corr(pregate ⊙ u, k) + D ⊙ pregate ⊙ u),
// corr(g, k)_t = sum_{s >= t} k[s - t] g_s (the backward's dv for g = dy ⊙ postgate).
struct TcForwardArgs {
  const void* u;
  const void* pregate;
  const void* postgate;
  const float2* S;
  const float* D;
  void* y;
  int B, H, L;
  bool gelu;
  bool correlate;
};
bool tc_forward_takes(Dtype dtype, int M, int cc_major, int smem_optin);
cudaError_t launch_tc_forward(int M, const TcForwardArgs& args, int num_sms, cudaStream_t stream);

// The filter's gradient on tensor cores (fftconv_tc_filter_grad.cu), bfloat16 rows, 1024 <= M <= 8192, without the activation
// pass: dk[h, j] = sum_b sum_t g[b, h, t] v[b, h, t - j], j < taps, with g = dy ⊙ postgate and v = u ⊙ pregate
// (either gate may be null). The plan gives the chunks of a head's batch rows and the scratch the launch needs:
// with one chunk the kernel writes dk itself ((H, Lk) of dk_dtype, zero past taps), else each chunk's share to
// dk_part (float32 (H, chunks, taps)), summed by the caller. table: plan.table_words 32-bit words (M = 8192).
// With dD_part (float32 (H, plan.dD_per_head)) it also writes the shares of dD = sum_b sum_t g v, summed by the
// caller over each row.
struct TcFilterGradPlan {
  int chunks = 0;
  int grid = 0;  // 0: the kernel does not fit
  int64_t table_words = 0, dD_per_head = 0;
};
struct TcFilterGradArgs {
  const void* dy;
  const void* postgate;
  const void* u;
  const void* pregate;
  void* dk;
  float* dk_part;
  float* dD_part;
  uint32_t* table;
  int B, H, L, Lk, taps;
  Dtype dk_dtype;
};
bool tc_filter_grad_takes(Dtype dtype, int M, int cc_major, int smem_optin);
TcFilterGradPlan tc_filter_grad_plan(int M, int B, int H, int num_sms);
cudaError_t launch_tc_filter_grad(int M, const TcFilterGradArgs& args, const TcFilterGradPlan& plan,
                                  cudaStream_t stream);

// The backward (bem/kernels/fftconv/custom_ops.py has the formulas). Outputs that are null are not
// computed. Each item (h, group of rows_per_group batch rows) writes its share of dk to dk_part, float32
// (H, groups, taps), and of dD to dD_part, float32 (H, groups). scratch: float32, backward_blocks() *
// backward_scratch_per_block(M), needed by the kFilter pass.
struct BackwardArgs {
  const void* dy;
  const void* u;
  const void* pregate;
  const void* postgate;
  const float2* S;
  const float* D;
  void* du;
  void* dpregate;
  void* dpostgate;
  float* dk_part;
  float* dD_part;
  float* scratch;
  float* g_rows;  // float32 (B, H, L): g, written by kActivation, read by kInputs and kFilter; or null
  int B, H, L, taps, groups, rows_per_group;
  bool gelu;
  BackwardPass pass;
};

// Shared memory one block of the spectrum length M takes (195 KB at M = 16384: more than an sm_80 GPU gives
// one block, where those lengths take the cuFFT path).
int block_smem_bytes(int M);
int backward_blocks(Dtype dtype, int M, int64_t items, int num_sms, BackwardPass pass, bool g_rows);
int64_t backward_scratch_per_block(int M);
cudaError_t launch_spectrum(int M, const SpectrumArgs& args, int num_sms, cudaStream_t stream);
cudaError_t launch_forward(Dtype dtype, int M, const ForwardArgs& args, int num_sms, cudaStream_t stream);
cudaError_t launch_backward(Dtype dtype, int M, const BackwardArgs& args, int blocks, cudaStream_t stream);

// ---- element-wise passes around cuFFT above M = 2^20 (fftconv_long.cu), rows of L, padded rows of 2M ----

// The rows of u, pregate, postgate, dy, du, dpregate, dpostgate (rows = B H, of L); h = row % H.
struct RowsArgs {
  const void* u;
  const void* pregate;
  const void* postgate;
  const void* dy;
  const float* D;  // float32 (H,) or null
  void* y;         // the forward's output
  void* du;
  void* dpregate;
  void* dpostgate;
  int64_t rows;
  int H, L;
  int log2_padded;  // the float32 rows below have 2M = 1 << log2_padded elements
  bool gelu;
};
// out[r, :L] = a[r] (⊙ gate[r]) in float32, out[r, L:] = 0 (a, gate: u and pregate, or dy and postgate).
cudaError_t launch_pad_rows(Dtype dtype, const void* a, const void* gate, float* out, const RowsArgs& rows,
                            cudaStream_t stream);
// y = postgate ⊙ act(conv + D ⊙ v) from float32 conv (padded rows).
cudaError_t launch_forward_epilogue(Dtype dtype, const float* conv, const RowsArgs& rows, cudaStream_t stream);
// From float32 conv (padded rows), c = conv + D ⊙ v: dpostgate = dy ⊙ act(c) (when not null) and
// g = dy ⊙ postgate ⊙ act'(c) into float32 padded rows (zero past L).
cudaError_t launch_activation_backward(Dtype dtype, const float* conv, float* g, const RowsArgs& rows,
                                       cudaStream_t stream);
// From float32 corr (padded rows), dv = corr + D ⊙ g (g: float32 padded rows): du = dv ⊙ pregate (dv
// without one), dpregate = dv ⊙ u; either may be null.
cudaError_t launch_input_grads(Dtype dtype, const float* corr, const float* g, const RowsArgs& rows,
                               cudaStream_t stream);

// dD's sums: part (rows, chunks) in double, each the sum of g v over a chunk of a row (v = u ⊙ pregate; g from
// float32 rows of g_stride, or dy ⊙ postgate where g_rows is null).
cudaError_t launch_dD_parts(Dtype dtype, const float* g_rows, int64_t g_stride, const RowsArgs& rows, double* part,
                            int chunks, cudaStream_t stream);

// ---- 16384 < M <= 2^20: a four-step FFT (fftconv_tiled.cu) ----
//
// work: float2 (rows, M). S: (H, M + 1) with S[h][k1 M2 + k2] = X[k1 + M1 k2] (k < M), S[h][M] = X[M], where
// X = rfft(k[h, :taps], n = 2M), M2 = kTiledRowLength, M1 = M / M2: the natural order's (M2, M1) block transposed.
bool tiled_length(int64_t M);
int tiled_rows_smem_bytes();
// work = the twiddled column transforms of the real rows a (⊙ gate), row r at a + r stride, `valid` elements.
cudaError_t launch_tiled_columns(Dtype dtype, const void* a, const void* gate, int64_t stride, int valid,
                                 int64_t rows, int M, float2* work, cudaStream_t stream);
// What one rows launch does with each pair of rows (fftconv_tiled.cu):
enum class TiledRows : int {
  kSpectrum,    // S[h] from the columns of the filter's rows (rows = H)
  kConv,        // the convolution's rows, in place (the forward)
  kGrad,        // per h, over its B batch rows: V's bins in place, acc (+)= G conj V, and with `grads` the
                // correlation of g with k into the g rows, in place
  kCorrInverse  // acc's rows (the correlation's bins) through the inverse, in place (rows = H)
};
struct TiledRowsArgs {
  float2* work;  // kSpectrum, kConv: the rows; kGrad: the g rows; kCorrInverse: acc
  float2* S;     // (H, M + 1)
  float2* V;     // kGrad: the v rows
  float2* acc;   // kGrad: (H, M); bins 0 and M of a row in its slot 0
  int64_t rows;
  int B, H, M;
  bool grads;
};
cudaError_t launch_tiled_rows(TiledRows mode, const TiledRowsArgs& args, int num_sms, cudaStream_t stream);
// The inverse columns, into: the forward's outputs (rows.y, the fields forward_epilogue reads); the convolution
// alone as float32 rows of `stride` (the backward's activation pass); the input gradients (the fields
// input_grads reads; g from g_rows, float32 rows of g_stride, or dy ⊙ postgate); dk's float32 (H, taps).
cudaError_t launch_tiled_epilogue(Dtype dtype, const float2* work, const RowsArgs& rows, int M,
                                  cudaStream_t stream);
cudaError_t launch_tiled_conv(const float2* work, float* out, int64_t stride, int64_t rows, int L, int M,
                              cudaStream_t stream);
cudaError_t launch_tiled_input_grads(Dtype dtype, const float2* work, const RowsArgs& rows, const float* g_rows,
                                     int64_t g_stride, int M, cudaStream_t stream);
cudaError_t launch_tiled_correlation(const float2* acc, float* dk, int H, int taps, int M, cudaStream_t stream);

// ---- the decoding step (fftconv_step.cu) ----

// One token per (b, h) row: history[row, p] = v = pregate ⊙ u_t, y = postgate ⊙ act(sum_{s<=p} k[h, p-s]
// history[row, s] + D[h] v). p from *position when not null (out of [0, Lmax): y = NaN, nothing written),
// else position_value. k has its own dtype; D is float32 or null.
struct StepArgs {
  void* history;
  const void* u;
  const void* pregate;
  const void* postgate;
  const void* k;
  const float* D;
  const int64_t* position;
  void* y;
  int64_t position_value;
  int rows, H, Lmax, Lk;
  bool gelu;
};
cudaError_t launch_step(Dtype dtype, Dtype k_dtype, const StepArgs& args, cudaStream_t stream);

}  // namespace fftconv
}  // namespace bem
