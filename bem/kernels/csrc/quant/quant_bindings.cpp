// Torch bindings of the kernels for quantized frozen weights: the 4-bit linear with BEM's update, at decode sizes
// (one kernel) and above them (the weight dequantized, then the low-rank family's linear; with autograd).
// Every operand is checked here (ValueError naming it) before anything is allocated or launched.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include "../common/device_info.h"
#include "../common/torch_checks.h"
#include "../lowrank/linear_autograd.h"
#include "../lowrank/update_ops.h"
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

// The 4-bit weight's operands checked against x's device and the weight's shape (N x K); its layout as the kernels
// read it.
Quant4DequantArgs checked_layout(const Tensor& x, const Tensor& weight, const Tensor& absmax, const Tensor& code,
                                 const OptTensor& absmax2, const OptTensor& code2, double offset, int64_t blocksize,
                                 int64_t blocksize2, int64_t N, int64_t K) {
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
  Quant4DequantArgs a{};
  a.W = weight.data_ptr<uint8_t>();
  a.absmax = nested ? nullptr : absmax.data_ptr<float>();
  a.absmax_u8 = nested ? absmax.data_ptr<uint8_t>() : nullptr;
  a.absmax2 = nested ? absmax2->data_ptr<float>() : nullptr;
  a.code2 = nested ? code2->data_ptr<float>() : nullptr;
  a.offset = (float)offset;
  a.code = code.data_ptr<float>();
  a.numel = N * K;
  a.blocksize = (int)blocksize;
  a.blocksize2 = nested ? (int)blocksize2 : 1;
  return a;
}

// x as the 4-bit kernels take it: on CUDA, float16 or bfloat16, contiguous, (..., K).
void check_x(const Tensor& x) {
  BEM_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  BEM_CHECK(tensor_core_dtype(x), "x must be float16 or bfloat16, got ", x.scalar_type());
  BEM_CHECK(x.dim() >= 1, "x must be (..., K), got a 0-d tensor");
  check_contiguous(x, "x");
}

// W (N, K) in x's dtype from a checked layout, in a fresh tensor.
Tensor dequantized(const Quant4DequantArgs& layout, const Tensor& x, int64_t N, int64_t K) {
  Tensor W = at::empty({N, K}, x.options());
  Quant4DequantArgs a = layout;
  a.out = W.data_ptr();
  C10_CUDA_CHECK(launch_quant4_dequantize(dtype_of(x), a, num_sms(x.get_device()), stream_now()));
  return W;
}

// W (N, K) in like's dtype and on its device: the dequantization the kernels above decode sizes multiply by.
Tensor quant4_dequantize(const Tensor& like, const Tensor& weight, const Tensor& absmax, const Tensor& code,
                         const OptTensor& absmax2, const OptTensor& code2, double offset, int64_t blocksize,
                         int64_t blocksize2, int64_t out_features, int64_t in_features) {
  check_x(like);
  const Quant4DequantArgs layout = checked_layout(like, weight, absmax, code, absmax2, code2, offset, blocksize,
                                                  blocksize2, out_features, in_features);
  const c10::cuda::CUDAGuard guard(like.device());
  return dequantized(layout, like, out_features, in_features);
}

// Y = x dequant(W)^T + b + s ((x V) ⊙ codes) U^T; see Quant4DecodeArgs for the layout of W and its statistics.
Tensor quant4_linear_decode(const Tensor& x, const Tensor& weight, const Tensor& absmax, const Tensor& code,
                            const c10::optional<Tensor>& absmax2, const c10::optional<Tensor>& code2, double offset,
                            int64_t blocksize, int64_t blocksize2, int64_t out_features, const OptTensor& bias,
                            const Tensor& V, const OptTensor& codes, const Tensor& U, double scaling) {
  check_x(x);
  BEM_CHECK(x.dim() == 2, "x must be 2-D (M, K), got shape ", shape_text(x.sizes()));
  const int64_t M = x.size(0), K = x.size(1), N = out_features;
  BEM_CHECK(M <= kQuant4DecodeMaxTokens, "x has ", M, " rows; the 4-bit decode kernel takes at most ",
            kQuant4DecodeMaxTokens);
  const Quant4DequantArgs layout =
      checked_layout(x, weight, absmax, code, absmax2, code2, offset, blocksize, blocksize2, N, K);
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
  a.W = layout.W;
  a.absmax = layout.absmax;
  a.absmax_u8 = layout.absmax_u8;
  a.absmax2 = layout.absmax2;
  a.code2 = layout.code2;
  a.offset = layout.offset;
  a.code = layout.code;
  a.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  a.P = P.data_ptr<float>();
  a.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  a.U = U.data_ptr();
  a.Y = Y.data_ptr();
  a.M = (int)M;
  a.N = (int)N;
  a.K = (int)K;
  a.r = (int)r;
  a.blocksize = layout.blocksize;
  a.blocksize2 = layout.blocksize2;
  a.scale = (float)scaling;
  a.rows_per_warp = quant4_rows_per_warp((int)N, num_sms(x.get_device()));
  C10_CUDA_CHECK(launch_quant4_decode(dtype_of(x), a, stream_now()));
  return Y;
}

// Above decode sizes, without autograd: W dequantized to x's dtype (freed on return), then the low-rank family's
// linear (its GEMM with the update inside where the shape takes it). x (..., K), codes (..., r).
Tensor quant4_linear(const Tensor& x, const Tensor& weight, const Tensor& absmax, const Tensor& code,
                     const OptTensor& absmax2, const OptTensor& code2, double offset, int64_t blocksize,
                     int64_t blocksize2, int64_t out_features, const OptTensor& bias, const Tensor& V,
                     const OptTensor& codes, const Tensor& U, double scaling) {
  check_x(x);
  const Quant4DequantArgs layout = checked_layout(x, weight, absmax, code, absmax2, code2, offset, blocksize,
                                                  blocksize2, out_features, x.size(-1));
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor W = dequantized(layout, x, out_features, x.size(-1));
  return std::get<0>(linear_forward(x, W, bias, V, codes, U, scaling, 0, 0, false, c10::nullopt, 0));
}

// quant4_linear under eager autograd: gradients for x, V, U and the codes, never the frozen weight. It keeps x, the
// codes and the packed weight (the layer's own tensors, no copy), as QLoRA keeps x: the backward dequantizes W again
// for dX, so no 16-bit weight outlives a call.
class Quant4LinearFunction : public torch::autograd::Function<Quant4LinearFunction> {
 public:
  static Tensor forward(torch::autograd::AutogradContext* ctx, const Tensor& x, const Tensor& V, const Tensor& U,
                        const OptTensor& codes, const OptTensor& bias, const Tensor& weight, const Tensor& absmax,
                        const Tensor& code, const OptTensor& absmax2, const OptTensor& code2, double offset,
                        int64_t blocksize, int64_t blocksize2, int64_t out_features, double scaling) {
    BEM_CHECK(!(bias.has_value() && bias->requires_grad()),
              "quant4_fused_linear trains V, U, x and the codes only; the bias must not require grad");
    Tensor y = quant4_linear(x, weight, absmax, code, absmax2, code2, offset, blocksize, blocksize2, out_features,
                             bias, V, codes, U, scaling);
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, V, U, codes.value_or(Tensor()), weight, absmax, code, absmax2.value_or(Tensor()),
                            code2.value_or(Tensor())});
    ctx->saved_data["offset"] = offset;
    ctx->saved_data["blocksize"] = blocksize;
    ctx->saved_data["blocksize2"] = blocksize2;
    ctx->saved_data["out_features"] = out_features;
    ctx->saved_data["scaling"] = scaling;
    return y;
  }

  // One gradient per argument of forward; x, V, U and codes (where given) come first, so their edges are 0-3.
  static torch::autograd::variable_list backward(torch::autograd::AutogradContext* ctx,
                                                 torch::autograd::variable_list grads) {
    torch::autograd::variable_list out(15);
    const Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return out;
    const auto saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &V = saved[1], &U = saved[2], &codes = saved[3];
    const bool need_x = ctx->needs_input_grad(0), need_v = ctx->needs_input_grad(1);
    const bool need_u = ctx->needs_input_grad(2), need_codes = codes.defined() && ctx->needs_input_grad(3);
    Tensor W;
    if (need_x) {
      const int64_t N = ctx->saved_data["out_features"].toInt(), K = x.size(-1);
      const Quant4DequantArgs layout = checked_layout(
          x, saved[4], saved[5], saved[6], saved[7].defined() ? OptTensor(saved[7]) : c10::nullopt,
          saved[8].defined() ? OptTensor(saved[8]) : c10::nullopt, ctx->saved_data["offset"].toDouble(),
          ctx->saved_data["blocksize"].toInt(), ctx->saved_data["blocksize2"].toInt(), N, K);
      const c10::cuda::CUDAGuard guard(x.device());
      W = dequantized(layout, x, N, K);
    }
    auto [dx, dv, dcodes, du] = fused_linear_backward(grad_y, x, W, V, codes, U,
                                                      ctx->saved_data["scaling"].toDouble(), need_x, need_v, need_u);
    if (need_x) out[0] = dx;
    if (need_v) out[1] = dv;
    if (need_u) out[2] = du;
    if (need_codes) out[3] = dcodes;
    return out;
  }
};

}  // namespace

void bind_quant(pybind11::module_& m) {
  m.def("quant4_linear_decode", &quant4_linear_decode,
        "x dequant(W)^T + b + s ((x V) ⊙ codes) U^T for a 4-bit weight in bitsandbytes' layout, up to 16 rows of x",
        py::arg("x"), py::arg("weight"), py::arg("absmax"), py::arg("code"), py::arg("absmax2"), py::arg("code2"),
        py::arg("offset"), py::arg("blocksize"), py::arg("blocksize2"), py::arg("out_features"), py::arg("bias"),
        py::arg("V"), py::arg("codes"), py::arg("U"), py::arg("scaling"));
  m.def("quant4_linear", &quant4_linear,
        "x dequant(W)^T + b + s ((x V) ⊙ codes) U^T for a 4-bit weight in bitsandbytes' layout, any number of rows "
        "of x (..., K): W dequantized, then the GEMM with the update inside; no autograd",
        py::arg("x"), py::arg("weight"), py::arg("absmax"), py::arg("code"), py::arg("absmax2"), py::arg("code2"),
        py::arg("offset"), py::arg("blocksize"), py::arg("blocksize2"), py::arg("out_features"), py::arg("bias"),
        py::arg("V"), py::arg("codes"), py::arg("U"), py::arg("scaling"));
  m.def(
      "quant4_fused_linear",
      [](const Tensor& x, const Tensor& weight, const Tensor& absmax, const Tensor& code, const OptTensor& absmax2,
         const OptTensor& code2, double offset, int64_t blocksize, int64_t blocksize2, int64_t out_features,
         const OptTensor& bias, const Tensor& V, const OptTensor& codes, const Tensor& U, double scaling) {
        return Quant4LinearFunction::apply(x, V, U, codes, bias, weight, absmax, code, absmax2, code2, offset,
                                           blocksize, blocksize2, out_features, scaling);
      },
      "quant4_linear under eager autograd: gradients for x, V, U and the codes; the backward dequantizes W again",
      py::arg("x"), py::arg("weight"), py::arg("absmax"), py::arg("code"), py::arg("absmax2"), py::arg("code2"),
      py::arg("offset"), py::arg("blocksize"), py::arg("blocksize2"), py::arg("out_features"), py::arg("bias"),
      py::arg("V"), py::arg("codes"), py::arg("U"), py::arg("scaling"));
  m.def("quant4_dequantize", &quant4_dequantize,
        "W (N, K) in like's dtype from a 4-bit weight in bitsandbytes' layout", py::arg("like"), py::arg("weight"),
        py::arg("absmax"), py::arg("code"), py::arg("absmax2"), py::arg("code2"), py::arg("offset"),
        py::arg("blocksize"), py::arg("blocksize2"), py::arg("out_features"), py::arg("in_features"));
  m.attr("QUANT4_DECODE_MAX_TOKENS") = kQuant4DecodeMaxTokens;
}

}  // namespace bem
