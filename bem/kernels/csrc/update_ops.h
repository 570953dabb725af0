// The generated update's entry points (defined in bindings.cpp), which the backward reuses on dY.
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

}  // namespace bem
