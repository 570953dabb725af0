// Argument checks shared by every family's torch bindings: every one raises ValueError (std::invalid_argument) with
// a message naming the operand, before anything is allocated or launched.
#pragma once

#include <torch/extension.h>

#include <c10/cuda/CUDAStream.h>

#include <climits>
#include <cstdint>
#include <stdexcept>
#include <string>

#include "dtype.h"

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

// An operand on the device of the call's leading input (named ref_name in the message), in contiguous memory.
inline void check_on(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name) {
  BEM_CHECK(t.device() == ref.device(), "", name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
  check_contiguous(t, name);
}

inline at::ScalarType p_dtype(const Tensor& x) { return x.scalar_type() == at::kDouble ? at::kDouble : at::kFloat; }

inline cudaStream_t stream_now() { return c10::cuda::getCurrentCUDAStream().stream(); }

}  // namespace bem
