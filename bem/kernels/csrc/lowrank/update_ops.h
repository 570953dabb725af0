// The generated update's and the fused linear's entry points (defined in bindings.cpp), which the backward and the
// eager autograd function (linear_autograd.cpp) reuse.
#pragma once

#include <ATen/ATen.h>

#include <cstdint>
#include <tuple>

namespace bem {

// (Y, P) = (s ((x V) ⊙ codes) U^T, x V); kernel, stream_tokens, stream_cluster: 0 picks by shape.
std::tuple<at::Tensor, at::Tensor> update_forward(const at::Tensor& x, const at::Tensor& V,
                                                  const c10::optional<at::Tensor>& codes, const at::Tensor& U,
                                                  double scale, int64_t kernel, int64_t stream_tokens,
                                                  int64_t stream_cluster);

// A B in float32 (float64 for double inputs): the backward's dY U.
at::Tensor project(const at::Tensor& A, const at::Tensor& B);

// (Y, P) = (x W^T + b + s ((x V) ⊙ codes) U^T, x V) for x (..., K); mode and split_k: 0 picks by shape; P only
// when need_p; V_t: V^T (r, K) where the caller keeps it; gemm_tile_n: 0 picks by shape.
std::tuple<at::Tensor, at::Tensor> linear_forward(const at::Tensor& x, const at::Tensor& weight,
                                                  const c10::optional<at::Tensor>& bias, const at::Tensor& V,
                                                  const c10::optional<at::Tensor>& codes, const at::Tensor& U,
                                                  double scale, int64_t mode, int64_t split_k, bool need_p,
                                                  const c10::optional<at::Tensor>& V_t, int64_t gemm_tile_n);

}  // namespace bem
