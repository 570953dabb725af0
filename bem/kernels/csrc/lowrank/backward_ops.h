// The backward's entry points at decode and prefill sizes (backward_ops.cpp), registered in bindings.cpp.
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace bem {

// (dX, dV, dcodes, dU) of the BEM linear (weight given) or of the update alone, for 1..64 rows. P = x V as
// the forward kept it, or None: recomputed from x and V.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> decode_backward(
    const at::Tensor& x, const at::Tensor& grad_y, const c10::optional<at::Tensor>& weight, const at::Tensor& V,
    const at::Tensor& U, const c10::optional<at::Tensor>& P, const c10::optional<at::Tensor>& codes, double scale);

// (s G ⊙ codes, s P ⊙ codes, s G ⊙ P) in dtype (float16 or bfloat16) from float32 G and P.
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward_coefficients(const at::Tensor& G, const at::Tensor& P,
                                                                     const c10::optional<at::Tensor>& codes,
                                                                     double scale, at::ScalarType dtype);

// (dX, dV, dcodes, dU) of the BEM linear above decode sizes; dV and dU undefined where not needed; P as above.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> prefill_backward(
    const at::Tensor& x, const at::Tensor& grad_y, const at::Tensor& weight, const at::Tensor& V,
    const at::Tensor& U, const c10::optional<at::Tensor>& P, const c10::optional<at::Tensor>& codes, double scale, bool dx_in_gemm,
    bool need_v, bool need_u);

// (dV, dcodes, dU) of the BEM linear above decode sizes without dX; dV and dU undefined where not needed.
std::tuple<at::Tensor, at::Tensor, at::Tensor> prefill_weight_grads(const at::Tensor& x, const at::Tensor& grad_y,
                                                                    const at::Tensor& V, const at::Tensor& U,
                                                                    const c10::optional<at::Tensor>& codes,
                                                                    double scale, bool need_v, bool need_u);

// Forces how the prefill backward's low-rank pieces run: -1 the fused launches where they take the call and the
// measured rule (rank 8, small M K N) says so, 0 the composition, 1 the fused launches (refused, with ValueError, where they cannot take the call).
void set_prefill_grads_path(int64_t path);

}  // namespace bem
