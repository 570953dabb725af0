// Torch bindings of the kernels for quantized frozen weights: the 4-bit linear with BEM's update at decode sizes.
// Every operand is checked here (ValueError naming it) before anything is allocated or launched.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/device_info.h"
#include "../common/torch_checks.h"
#include "quant_launchers.h"

namespace bem {
namespace {

void check_on(const Tensor& t, const char* name, const Tensor& x) { bem::check_on(t, name, x, "x"); }

void check_typed(const Tensor& t, const char* name, const Tensor& x, at::ScalarType dtype, int64_t numel) {
  check_on(t, name, x);
  BEM_CHECK(t.scalar_type() == dtype, "", name, " must be ", dtype, ", got ", t.scalar_type());
  BEM_CHECK(t.numel() == numel, "", name, " must hold ", numel, " values, got ", t.numel(), " (shape ",
            shape_text(t.sizes()), ")");
}

// Y = x dequant(W)^T + b + s ((x V) ⊙ codes) U^T; see Quant4DecodeArgs for the layout of W and its statistics.
Tensor quant4_linear_decode(const Tensor& x, const Tensor& weight, const Tensor& absmax, const Tensor& code,
                            const c10::optional<Tensor>& absmax2, const c10::optional<Tensor>& code2, double offset,
                            int64_t blocksize, int64_t blocksize2, int64_t out_features, const OptTensor& bias,
                            const Tensor& V, const OptTensor& codes, const Tensor& U, double scaling) {
  BEM_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  BEM_CHECK(tensor_core_dtype(x), "x must be float16 or bfloat16, got ", x.scalar_type());
  BEM_CHECK(x.dim() == 2, "x must be 2-D (M, K), got shape ", shape_text(x.sizes()));
  check_contiguous(x, "x");
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  BEM_CHECK(M <= kQuant4DecodeMaxTokens, "x has ", M, " rows; the 4-bit decode kernel takes at most ",
            kQuant4DecodeMaxTokens);
  BEM_CHECK(K % 32 == 0, "K = ", K, " must be a multiple of 32");
  BEM_CHECK(N > 0 && N < INT_MAX && K < INT_MAX && N * K < ((int64_t)1 << 40), "out_features = ", N,
            " and K = ", K, " are out of range");
  BEM_CHECK(blocksize > 0 && blocksize % 32 == 0, "blocksize must be a positive multiple of 32, got ", blocksize);
  const int64_t blocks = (N * K + blocksize - 1) / blocksize;
  check_typed(weight, "weight", x, at::kByte, N * K / 2);
  check_typed(code, "code", x, at::kFloat, 16);
  const bool nested = absmax2.has_value();
  BEM_CHECK(nested == code2.has_value(), "absmax2 and code2 come together (double quantization), or neither");
  if (nested) {
    BEM_CHECK(blocksize2 > 0, "blocksize2 must be positive, got ", blocksize2);
    check_typed(absmax, "absmax", x, at::kByte, blocks);
    check_typed(*absmax2, "absmax2", x, at::kFloat, (blocks + blocksize2 - 1) / blocksize2);
    check_typed(*code2, "code2", x, at::kFloat, 256);
  } else {
    check_typed(absmax, "absmax", x, at::kFloat, blocks);
  }
  BEM_CHECK(V.dim() == 2 && V.size(0) == K, "V must be (K, r) = (", K, ", r), got ", shape_text(V.sizes()));
  const int64_t r = V.size(1);
  check_on(V, "V", x);
  BEM_CHECK(V.scalar_type() == x.scalar_type(), "V has dtype ", V.scalar_type(), " but x has ", x.scalar_type());
  check_typed(U, "U", x, x.scalar_type(), N * r);
  BEM_CHECK(U.dim() == 2 && U.size(0) == N, "U must be (N, r) = (", N, ", ", r, "), got ", shape_text(U.sizes()));
  if (codes.has_value()) {
    check_typed(*codes, "codes", x, x.scalar_type(), M * r);
    BEM_CHECK(codes->dim() == 2 && codes->size(0) == M, "codes must be (M, r) = (", M, ", ", r, "), got ",
              shape_text(codes->sizes()));
  }
  if (bias.has_value()) check_typed(*bias, "bias", x, x.scalar_type(), N);

  const c10::cuda::CUDAGuard guard(x.device());
  Tensor Y = at::empty({M, N}, x.options());
  if (M == 0) return Y;
  const Tensor P = at::mm(x, V, at::kFloat);  // cuBLAS, float32 accumulation kept unrounded
  Quant4DecodeArgs a{};
  a.x = x.data_ptr();
  a.W = weight.data_ptr<uint8_t>();
  a.absmax = nested ? nullptr : absmax.data_ptr<float>();
  a.absmax_u8 = nested ? absmax.data_ptr<uint8_t>() : nullptr;
  a.absmax2 = nested ? absmax2->data_ptr<float>() : nullptr;
  a.code2 = nested ? code2->data_ptr<float>() : nullptr;
  a.offset = (float)offset;
  a.code = code.data_ptr<float>();
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.P = P.data_ptr<float>();
  a.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  a.U = U.data_ptr();
  a.Y = Y.data_ptr();
  a.M = (int)M;
  a.N = (int)N;
  a.K = (int)K;
  a.r = (int)r;
  a.blocksize = (int)blocksize;
  a.blocksize2 = nested ? (int)blocksize2 : 1;
  a.scale = (float)scaling;
  a.rows_per_warp = quant4_rows_per_warp((int)N, num_sms(x.get_device()));
  C10_CUDA_CHECK(launch_quant4_decode(dtype_of(x), a, stream_now()));
  return Y;
}

}  // namespace

void bind_quant(pybind11::module_& m) {
  m.def("quant4_linear_decode", &quant4_linear_decode,
        "x dequant(W)^T + b + s ((x V) ⊙ codes) U^T for a 4-bit weight in bitsandbytes' layout, up to 16 rows of x",
        py::arg("x"), py::arg("weight"), py::arg("absmax"), py::arg("code"), py::arg("absmax2"), py::arg("code2"),
        py::arg("offset"), py::arg("blocksize"), py::arg("blocksize2"), py::arg("out_features"), py::arg("bias"),
        py::arg("V"), py::arg("codes"), py::arg("U"), py::arg("scaling"));
  m.attr("QUANT4_DECODE_MAX_TOKENS") = kQuant4DecodeMaxTokens;
}

}  // namespace bem
