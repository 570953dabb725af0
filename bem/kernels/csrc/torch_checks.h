// Argument checks shared by the torch bindings: every one raises ValueError (std::invalid_argument) with
// a message naming the operand, before anything is allocated or launched.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "launchers.h"

namespace bem {

using at::Tensor;
using OptTensor = c10::optional<Tensor>;

// Raises ValueError on the Python side: pybind11 translates std::invalid_argument.
#define BEM_CHECK(cond, ...)                                                   \
  do {                                                                         \
    if (!(cond)) throw std::invalid_argument(c10::str("bem: ", __VA_ARGS__)); \
  } while (0)

// A shape as Python writes a tuple, for messages about the operands a Python call gave.
inline std::string shape_text(c10::IntArrayRef sizes) {
  std::string text = "(";
  for (size_t i = 0; i < sizes.size(); ++i) text += std::to_string(sizes[i]) + (i + 1 < sizes.size() ? ", " : "");
  return text + (sizes.size() == 1 ? ",)" : ")");
}

inline DType dtype_of(const Tensor& t) {
  switch (t.scalar_type()) {
    case at::kHalf: return DType::kHalf;
    case at::kBFloat16: return DType::kBFloat16;
    case at::kFloat: return DType::kFloat;
    case at::kDouble: return DType::kDouble;
    default: break;
  }
  BEM_CHECK(false, "unsupported dtype ", t.scalar_type(), " (expected float16, bfloat16, float32 or float64)");
  return DType::kFloat;
}

inline bool tensor_core_dtype(const Tensor& t) {
  return t.scalar_type() == at::kHalf || t.scalar_type() == at::kBFloat16;
}

inline void check_like(const Tensor& t, const char* name, const Tensor& x) {
  BEM_CHECK(t.device() == x.device(), "", name, " is on ", t.device(), " but x is on ", x.device());
  BEM_CHECK(t.scalar_type() == x.scalar_type(), "", name, " has dtype ", t.scalar_type(), " but x has ",
              x.scalar_type());
}

inline void check_contiguous(const Tensor& t, const char* name) {
  BEM_CHECK(t.is_contiguous(), "", name, " must be contiguous; got sizes ", t.sizes(), " strides ",
              t.strides());
}

// x: (M, K), V: (K, r), codes: (M, r) or None, U: (N, r).
inline void check_update_operands(const Tensor& x, const Tensor& V, const OptTensor& codes, const Tensor& U) {
  BEM_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  BEM_CHECK(x.dim() == 2, "x must be 2-D (M, K), got shape ", x.sizes());
  BEM_CHECK(V.dim() == 2, "V must be 2-D (K, r), got shape ", V.sizes());
  BEM_CHECK(U.dim() == 2, "U must be 2-D (N, r), got shape ", U.sizes());
  dtype_of(x);
  check_like(V, "V", x);
  check_like(U, "U", x);
  check_contiguous(x, "x");
  check_contiguous(V, "V");
  check_contiguous(U, "U");
  BEM_CHECK(V.size(0) == x.size(1), "V has ", V.size(0), " rows but x has K = ", x.size(1), " features");
  BEM_CHECK(U.size(1) == V.size(1), "U has rank ", U.size(1), " but V has rank ", V.size(1));
  BEM_CHECK(V.size(1) >= 1, "rank must be at least 1");
  BEM_CHECK(x.size(0) < INT_MAX && x.size(1) < INT_MAX && U.size(0) < INT_MAX,
              "dimensions must be below 2^31, got x ", x.sizes(), " and U ", U.sizes());
  if (tensor_core_dtype(x)) {
    BEM_CHECK(V.size(1) <= kMaxFusedRank, "rank ", V.size(1), " exceeds the kernels' maximum of ",
                kMaxFusedRank, " for ", x.scalar_type());
  }
  if (codes.has_value()) {
    const Tensor& c = *codes;
    check_like(c, "codes", x);
    check_contiguous(c, "codes");
    BEM_CHECK(c.dim() == 2 && c.size(0) == x.size(0) && c.size(1) == V.size(1), "codes must be (M, r) = (",
                x.size(0), ", ", V.size(1), "), got ", c.sizes());
  }
}

// The (N, K) weight as the transposed view of a row-major (K, N) tensor (GPT-2's Conv1D, the backward's W^T).
inline bool weight_is_transposed(const Tensor& W) {
  return W.size(0) > 1 && W.size(1) > 1 ? (W.stride(0) == 1 && W.stride(1) == W.size(0)) : false;
}

// weight: (N, K) row-major or weight_is_transposed; bias: (N,) or None; N from U (N, r), K from x (M, K).
inline void check_weight(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& U) {
  check_like(weight, "weight", x);
  BEM_CHECK(weight.dim() == 2 && weight.size(0) == U.size(0) && weight.size(1) == x.size(1),
              "weight must be (N, K) = (", U.size(0), ", ", x.size(1), "), got ", weight.sizes());
  BEM_CHECK(weight.is_contiguous() || weight_is_transposed(weight),
              "weight must be row-major (N, K) or the transpose of a row-major (K, N) tensor; got strides ",
              weight.strides());
  if (bias.has_value()) {
    check_like(*bias, "bias", x);
    check_contiguous(*bias, "bias");
    BEM_CHECK(bias->dim() == 1 && bias->size(0) == U.size(0), "bias must be (N,) = (", U.size(0),
                ",), got ", bias->sizes());
  }
}

inline at::ScalarType p_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

inline cudaStream_t stream_now() { return c10::cuda::getCurrentCUDAStream().stream(); }

// A float32 (M, r) operand such as P = x V or G = dY U, on the device of `ref` (named ref_name).
inline void check_p_like(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name, int64_t M,
                         int64_t r) {
  BEM_CHECK(t.device() == ref.device(), "", name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
  BEM_CHECK(t.scalar_type() == at::kFloat, "", name, " must be float32, got ", t.scalar_type());
  check_contiguous(t, name);
  BEM_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == r, "", name, " must be (M, r) = (", M, ", ", r,
            "), got ", t.sizes());
}

}  // namespace bem
