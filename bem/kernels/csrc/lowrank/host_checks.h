// What the low-rank update's bindings check of their operands (each check raises ValueError naming the operand,
// before anything is allocated or launched) and of the device.
#pragma once

#include "../common/device_info.h"
#include "../common/torch_checks.h"
#include "launchers.h"

namespace bem {

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

// A float32 (M, r) operand such as P = x V or G = dY U, on the device of `ref` (named ref_name).
inline void check_p_like(const Tensor& t, const char* name, const Tensor& ref, const char* ref_name, int64_t M,
                         int64_t r) {
  BEM_CHECK(t.device() == ref.device(), "", name, " is on ", t.device(), " but ", ref_name, " is on ", ref.device());
  BEM_CHECK(t.scalar_type() == at::kFloat, "", name, " must be float32, got ", t.scalar_type());
  check_contiguous(t, name);
  BEM_CHECK(t.dim() == 2 && t.size(0) == M && t.size(1) == r, "", name, " must be (M, r) = (", M, ", ", r,
            "), got ", t.sizes());
}

// Whether this build has its sm_90a kernels (the GEMM with the update inside, the TMA update kernel)
// for the device: sm_90a code on a compute capability 9.0 GPU.
inline bool sm90a_runs(int device) {
  bool supported = false;
  C10_CUDA_CHECK(gemm_update_supported(device, stream_now(), &supported));
  return supported;
}

}  // namespace bem
