// What the fftconv bindings (fftconv_bindings.cpp) and the four-step form's host side (fftconv_tiled_ops.cpp)
// share: the argument checks, naming the operand (ValueError, or TypeError for a dtype), the shape of a call, which
// path takes a spectrum length on the device, and the four-step passes' entry points.
#pragma once

#include <torch/extension.h>

#include <cstdlib>
#include <string>
#include <vector>

#include "../common/device_info.h"
#include "fftconv.h"

namespace bem {
namespace fftconv_host {

namespace fc = fftconv;
using at::Tensor;
using OptTensor = c10::optional<Tensor>;

#define FFTCONV_CHECK(cond, ...) \
  if (!(cond)) throw std::invalid_argument(c10::str("bem fftconv: ", __VA_ARGS__))
#define FFTCONV_CHECK_DTYPE(cond, ...) \
  if (!(cond)) throw pybind11::type_error(c10::str("bem fftconv: ", __VA_ARGS__))

inline fc::Dtype dtype_of(const Tensor& t, const char* name) {
  switch (t.scalar_type()) {
    case at::kHalf: return fc::Dtype::kHalf;
    case at::kBFloat16: return fc::Dtype::kBFloat16;
    case at::kFloat: return fc::Dtype::kFloat;
    default: break;
  }
  FFTCONV_CHECK_DTYPE(false, name, " must be float16, bfloat16 or float32 for the kernels, got ", t.scalar_type());
  return fc::Dtype::kFloat;
}

inline void check_on(const Tensor& t, const char* name, const Tensor& u) {
  FFTCONV_CHECK(t.device() == u.device(), name, " is on ", t.device(), " but u is on ", u.device());
  FFTCONV_CHECK(t.is_contiguous(), name, " must be contiguous; got sizes ", t.sizes(), " strides ", t.strides());
}

// The block kernels take spectrum lengths up to 16384 where a block's shared memory fits the device.
inline bool block_path(int64_t M, int device) {
  return M <= fc::kMaxBlockSpectrum && fc::block_smem_bytes((int)M) <= shared_memory_optin(device);
}

// The four-step forward takes 16384 < M <= 2^20 where its rows kernel's shared memory fits the device.
inline bool tiled_path(int64_t M, int device) {
  return fc::tiled_length(M) && fc::tiled_rows_smem_bytes() <= shared_memory_optin(device);
}

// The tensor-core kernels unless BEM_FFTCONV_TENSOR_CORES=0 (the benchmark's and the tests' way to time and check
// the block kernels beside them); read per call, so that one process may time both.
inline bool tensor_cores_allowed() {
  const char* off = std::getenv("BEM_FFTCONV_TENSOR_CORES");
  return !(off != nullptr && std::string(off) == "0");
}

// The tensor-core forward takes bfloat16 rows of 1024 <= M <= 8192 on compute capability 9.0 and later.
inline bool tc_path(const fc::Dtype dtype, int64_t M, int device) {
  return tensor_cores_allowed() &&
         fc::tc_forward_takes(dtype, (int)M, cc_major(device), shared_memory_optin(device));
}

// The filter's gradient on tensor cores: the same rows and lengths
inline bool tc_filter_grad_path(const fc::Dtype dtype, int64_t M, int device) {
  return tensor_cores_allowed() &&
         fc::tc_filter_grad_takes(dtype, (int)M, cc_major(device), shared_memory_optin(device));
}

// The whole backward on tensor cores: no GELU (the activation's derivative would need c's rows), bf16 rows of
// 1024 <= M <= 8192, and the filter-gradient kernel where dk is wanted
inline bool tc_backward_takes(const fc::Dtype dtype, int64_t M, bool gelu, bool need_k, int device) {
  return !gelu && tc_path(dtype, M, device) && (!need_k || tc_filter_grad_path(dtype, M, device));
}

inline const void* ptr(const OptTensor& t) { return t.has_value() ? t->data_ptr() : nullptr; }

struct Shape {
  int64_t B, H, L, Lk, M, taps;
  fc::Dtype dtype;
};

// float2 rows of M for the four-step passes
inline Tensor tiled_work(int64_t rows, int64_t M, const Tensor& like) {
  return at::empty({rows, M}, like.options().dtype(at::kComplexFloat));
}
inline float2* f2(const Tensor& t) { return reinterpret_cast<float2*>(t.data_ptr()); }

// The element-wise passes' arguments (fftconv_long.cu), shared by the four-step form and cuFFT's.
fc::RowsArgs rows_args(const Shape& s, const Tensor& u, const OptTensor& pregate, const OptTensor& postgate,
                       const OptTensor& D32, bool gelu);

// (H, taps) float32 -> (H, Lk) in k's dtype
Tensor dk_of(const Tensor& correlation, const Tensor& k);

// S in rfft's order (the four-step order's first M bins are the natural order's (M2, M1) block transposed).
Tensor natural_spectrum(const Tensor& S, int64_t M, int device);

// The four-step convolution of v = u ⊙ pregate with the filter (spectrum S) up to its inverse columns: the
// columns and the rows (the product and the inverse rows), into new work rows.
Tensor tiled_convolve(const Shape& s, const Tensor& u, const OptTensor& pregate, const Tensor& S);

// dD = sum over b and t of g v, per h: double sums over chunks of each row, then over b and the chunks.
Tensor dD_sum(const Shape& s, const fc::RowsArgs& r, const float* g_rows, int64_t g_stride, const Tensor& D);

// The backward for 16384 < M <= 2^20 in the four-step form (fftconv_tiled_ops.cpp).
void tiled_backward(const Shape& s, const Tensor& u, const Tensor& grad_y, const OptTensor& pregate,
                    const OptTensor& postgate, const OptTensor& D, const Tensor& S, const fc::RowsArgs& r,
                    bool need_c, bool need_inputs, bool need_k, bool need_D, const Tensor& k, Tensor& dk,
                    Tensor& dD);

}  // namespace fftconv_host
}  // namespace bem
