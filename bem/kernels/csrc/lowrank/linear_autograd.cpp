// The fused linear under eager autograd as a C++ autograd function, bound as bem._C.fused_linear.
//
// In an eager training step of a small or narrow model each wrapped linear is bound by host time. A Python
// autograd.Function costs a Python call in the forward and, in the backward, the autograd engine taking the GIL
// to run Python on its device thread: on SmolLM-135M's shapes (210 wrapped linears, b8 s1024, H200) the
// backward's Python took about 26 ms of a 99 ms backward that issued in 61 ms for the frozen model. Here the
// forward is one C++ call and the backward never enters Python. The kernels and their choice are those of the
// custom ops' backward (custom_ops.lowrank_backward): the decode-size kernels for 1..64 rows, the prefill
// backward above, and without dX (a first layer's projections, whose input needs no gradient) its low-rank
// pieces alone (prefill_weight_grads). torch.compile never sees this function: traced code takes the custom ops.
#include <torch/extension.h>

#include <cstdint>
#include <tuple>

#include "backward_ops.h"
#include "gemm_update_ops.h"
#include "launchers.h"
#include "host_checks.h"
#include "linear_autograd.h"
#include "update_ops.h"

namespace bem {

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

namespace {

// (dX, dV, dcodes, dU) from the flattened operands, with the needs given; x and dY (rows, K) and (rows, N).
std::tuple<Tensor, Tensor, Tensor, Tensor> fused_linear_grads(const Tensor& x, const Tensor& dy, const Tensor& weight,
                                                              const Tensor& V, const OptTensor& codes, const Tensor& U,
                                                              double scale, bool need_x, bool need_v, bool need_u) {
  if (x.size(0) <= kDecodeMaxTokens)
    return decode_backward(x, dy, need_x ? OptTensor(weight) : c10::nullopt, V, U, c10::nullopt, codes, scale);
  if (need_x)
    return prefill_backward(x, dy, weight, V, U, c10::nullopt, codes, scale, prefill_dx_in_gemm(dy, weight.t(), V),
                            need_v, need_u);
  auto [dv, dcodes, du] = prefill_weight_grads(x, dy, V, U, codes, scale, need_v, need_u);
  return {Tensor(), dv, dcodes, du};
}

}  // namespace

std::tuple<Tensor, Tensor, Tensor, Tensor> fused_linear_backward(const Tensor& grad_y, const Tensor& x,
                                                                 const Tensor& weight, const Tensor& V,
                                                                 const Tensor& codes, const Tensor& U, double scale,
                                                                 bool need_x, bool need_v, bool need_u) {
  const int64_t rows = x.numel() / x.size(-1);
  const Tensor dy = grad_y.reshape({rows, grad_y.size(-1)}).contiguous();
  const OptTensor codes_rows = codes.defined() ? OptTensor(codes.view({rows, codes.size(-1)})) : c10::nullopt;
  auto [dx, dv, dcodes, du] =
      fused_linear_grads(x.view({rows, x.size(-1)}), dy, weight, V, codes_rows, U, scale, need_x, need_v, need_u);
  return {need_x && dx.defined() ? dx.view(x.sizes()) : Tensor(), dv,
          codes.defined() && dcodes.defined() ? dcodes.view(codes.sizes()) : Tensor(), du};
}

// y = x W^T + b + s ((x V) ⊙ codes) U^T for x (..., K) and codes (..., r), W and b frozen. Keeps x and the codes
// for the backward, as LoRA keeps x and its rank-r activation; x V is recomputed there.
class FusedLinearFunction : public torch::autograd::Function<FusedLinearFunction> {
 public:
  static Tensor forward(AutogradContext* ctx, const Tensor& x, const Tensor& weight, const OptTensor& bias,
                        const Tensor& V, const OptTensor& codes, const Tensor& U, double scale) {
    // its backward gives no gradient to W or b: refused, not silently left without one
    BEM_CHECK(!weight.requires_grad() && !(bias.has_value() && bias->requires_grad()),
              "fused_linear trains V, U, x and the codes only; the weight and bias must not require grad");
    // mode 0 and split 0: by shape; no x V kept
    Tensor y = std::get<0>(linear_forward(x, weight, bias, V, codes, U, scale, 0, 0, false, c10::nullopt, 0));
    ctx->set_materialize_grads(false);
    ctx->save_for_backward({x, weight, V, codes.value_or(Tensor()), U});
    ctx->saved_data["scale"] = scale;
    ctx->saved_data["has_bias"] = bias.has_value() && bias->defined();
    return y;
  }

  // One gradient per argument of forward: x, weight, bias, V, codes, U, scale.
  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    variable_list out(7);
    const Tensor& grad_y = grads[0];
    if (!grad_y.defined()) return out;
    const variable_list saved = ctx->get_saved_variables();
    const Tensor &x = saved[0], &weight = saved[1], &V = saved[2], &codes = saved[3], &U = saved[4];
    // needs_input_grad counts the tensors given (x, weight, then bias and codes where given, V, U)
    const size_t v_edge = ctx->saved_data["has_bias"].toBool() ? 3 : 2;
    const bool need_x = ctx->needs_input_grad(0), need_v = ctx->needs_input_grad(v_edge);
    const bool need_codes = codes.defined() && ctx->needs_input_grad(v_edge + 1);
    const bool need_u = ctx->needs_input_grad(v_edge + (codes.defined() ? 2 : 1));
    auto [dx, dv, dcodes, du] = fused_linear_backward(grad_y, x, weight, V, codes, U,
                                                      ctx->saved_data["scale"].toDouble(), need_x, need_v, need_u);
    if (need_x) out[0] = dx;
    if (need_v) out[3] = dv;
    if (need_codes) out[4] = dcodes;
    if (need_u) out[5] = du;
    return out;
  }
};

void bind_linear_autograd(pybind11::module_& m) {
  m.def(
      "fused_linear",
      [](const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& V, const OptTensor& codes,
         const Tensor& U, double scale) { return FusedLinearFunction::apply(x, weight, bias, V, codes, U, scale); },
      "x W^T + b + s ((x V) ⊙ codes) U^T under eager autograd (W and b frozen), its backward in C++",
      py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("V"), py::arg("codes"), py::arg("U"),
      py::arg("scaling"));
  m.def("set_prefill_dx_path", &set_prefill_dx_path,
        "force the prefill backward's dX path: -1 by the measured rule, 0 the update kernels, 1 the fused GEMM",
        py::arg("path"));
  m.def("set_prefill_grads_path", &set_prefill_grads_path,
        "force how the prefill backward's low-rank pieces run: -1 by the measured rule (rank 8, small M K N), 0 "
        "composed (cuBLAS), 1 the fused launches",
        py::arg("path"));
  m.def("prefill_weight_grads", &prefill_weight_grads,
        "(dV, dcodes, dU) of the BEM linear above decode sizes without dX (dV, dU None where not asked for)",
        py::arg("x"), py::arg("grad_y"), py::arg("V"), py::arg("U"), py::arg("codes"), py::arg("scaling"),
        py::arg("need_v") = true, py::arg("need_u") = true);
  m.def("prefill_dx_in_gemm", &prefill_dx_in_gemm,
        "whether the prefill backward's dX comes from the fused GEMM: forced (refused where it cannot take the "
        "operands) or by the measured rule",
        py::arg("grad_y"), py::arg("weight_t"), py::arg("V"));
}

}  // namespace bem
