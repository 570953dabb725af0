// The fused linear's backward from its saved operands (linear_autograd.cpp), for the autograd functions of other
// families whose frozen weight is stored otherwise (the 4-bit linear dequantizes it again for dX).
#pragma once

#include <ATen/ATen.h>

#include <tuple>

namespace bem {

// (dX, dV, dcodes, dU) of y = x W^T + b + s ((x V) ⊙ codes) U^T from dY, x (..., K) and codes (..., r, or
// undefined) as the forward had them; W (N, K) is read only for dX. A gradient not asked for comes back undefined.
std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> fused_linear_backward(
    const at::Tensor& grad_y, const at::Tensor& x, const at::Tensor& weight, const at::Tensor& V,
    const at::Tensor& codes, const at::Tensor& U, double scale, bool need_x, bool need_v, bool need_u);

}  // namespace bem
