// The BEM linear as one GEMM with the update inside (gemm_update.cu): when the default dispatch picks it,
// and the call itself (linear modes 6 and 7 of linear_forward).
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace bem {

// The default dispatch's use of the GEMM (x: (M, K), 2-D), where it takes the operands and measured
// faster: kInside (linear mode 6) where K x N is within the limit measured for the rank and the tiles fill
// the GPU (128 x 256 ones at least half of it, or at r = 8 and K <= 4096 128 x 128 ones 2/3 of it), or
// the call is short enough for its host time to be the bound (up to 2048 rows, M K N <= 2^34, r <= 32;
// not under CUDA-graph capture);
// kProjected (mode 7) at a few hundred rows from rank 32 where the 128 x 128 tiles fill half the GPU; kNone
// elsewhere. The weight may be row-major or the transposed view of a row-major (K, N) tensor (GPT-2's
// Conv1D): the same limits held for both layouts.
enum class GemmUpdateChoice { kNone, kInside, kProjected };
GemmUpdateChoice gemm_update_choice(const at::Tensor& x, const at::Tensor& weight,
                                    const c10::optional<at::Tensor>& bias, const at::Tensor& V, const at::Tensor& U);

// (Y, P) with Y = x W^T + b + s ((x V) ⊙ codes) U^T from one GEMM; P = x V (float32) when need_p.
// projected: cuBLAS computes P first and the GEMM adds (s P ⊙ codes) U^T (mode 7); otherwise the GEMM
// computes P itself from V^T (Vt, r x K contiguous, or a copy made here when null; mode 6). Either takes a
// row-major weight or the transposed view of a row-major (K, N) tensor.
// tile_n: the tiles' columns, 128 or 256, or 0 to choose by shape. Refuses what it cannot take.
std::tuple<at::Tensor, at::Tensor> gemm_update_linear(const at::Tensor& x, const at::Tensor& weight,
                                                      const c10::optional<at::Tensor>& bias, const at::Tensor& V,
                                                      const c10::optional<at::Tensor>& codes, const at::Tensor& U,
                                                      double scale, bool projected, bool need_p,
                                                      const at::Tensor* Vt, int64_t tile_n);

// Y = x W^T + b + Pc U^T from the GEMM given Pc (M, r) in x's dtype, with W (N, K) row-major or the transposed
// view of a row-major (K, N) tensor: the backward's dX = dY W + (s G ⊙ codes) V^T passes (dY, W^T, s G ⊙ codes,
// V). tile_n as above.
at::Tensor gemm_update_given(const at::Tensor& x, const at::Tensor& weight, const c10::optional<at::Tensor>& bias,
                             const at::Tensor& Pc, const at::Tensor& U, int64_t tile_n);
// Whether gemm_update_given takes (x, weight, U) as they are (without a bias), on this build and device.
bool gemm_update_given_takes(const at::Tensor& x, const at::Tensor& weight, const at::Tensor& U);
// Whether the backward's dX = dY W + (s G ⊙ codes) V^T comes from gemm_update_given(dY, W^T, ..., V): where
// it takes the operands and measured faster than the update kernels on dY with cuBLAS adding dY W.
// grad_y: (M, N), weight_t: W^T (K, N), V: (K, r).
bool backward_dx_in_gemm(const at::Tensor& grad_y, const at::Tensor& weight_t, const at::Tensor& V);
// The same choice as the backward makes it: forced by set_prefill_dx_path (a forced GEMM refused, with
// ValueError, where it cannot take the operands), or by the rule above.
bool prefill_dx_in_gemm(const at::Tensor& grad_y, const at::Tensor& weight_t, const at::Tensor& V);
// path: -1 by the rule, 0 the update kernels on dY with cuBLAS adding dY W, 1 the fused GEMM.
void set_prefill_dx_path(int64_t path);

}  // namespace bem
