// The update's projection through cuBLAS: P = A B in float32, and s P ⊙ codes for the expansion.
#pragma once

#include <c10/cuda/CUDAException.h>

#include <utility>

#include "launchers.h"
#include "host_checks.h"

namespace bem {

// A B with fp32 output: cuBLAS accumulates fp16/bf16 products in fp32 and keeps them unrounded.
inline Tensor project_gemm(const Tensor& A, const Tensor& B) {
  return tensor_core_dtype(A) ? at::mm(A, B, at::kFloat) : at::mm(A, B).to(p_dtype(A));
}

// P = A B from cuBLAS (fp32) and Pc = s P ⊙ codes rounded to A's dtype.
inline std::pair<Tensor, Tensor> scaled_projection(const Tensor& A, const Tensor& B, const OptTensor& codes,
                                                   double scale) {
  Tensor P = project_gemm(A, B);
  Tensor Pc = at::empty(P.sizes(), A.options());
  C10_CUDA_CHECK(launch_scale_codes(dtype_of(A), P.data_ptr<float>(), codes.has_value() ? codes->data_ptr() : nullptr,
                                    Pc.data_ptr(), P.numel(), (float)scale, stream_now()));
  return {P, Pc};
}

}  // namespace bem
