// Torch bindings of the mLSTM kernels (mlstm_*.cu): argument checks that name the operand, allocation,
// launches. Python reaches them through bem/kernels/mlstm/custom_ops.py.
//
//   mlstm_forward(q, k, v, igate, fgate, C0, n0, m0, state_cols=0)
//       -> [h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states]
//   mlstm_backward(dh, q, k, v, igate, fgate, m_tok, den_tok, beta, C_states, n_states, m_states, dC_last, dn_last,
//                  state_cols=0) -> [dq, dk, dv, qdq, kdk, dC0, dn0]
//   mlstm_beta(dh, h, m_tok, den_tok) -> beta
//   mlstm_step(q, k, v, igate, fgate, C, n, m) -> [h, C', n', m']
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <climits>
#include <cstdint>
#include <vector>

#include "../common/device_info.h"
#include "mlstm_launchers.h"
#include "../common/torch_checks.h"

namespace bem {
namespace {

struct Dims {
  int64_t B, NH, S, DK, DV;
};

// The kernels' operands: CUDA, float16 / bfloat16 / float32 (float64 runs the PyTorch reference).
void check_kernel_dtype(const Tensor& q) {
  BEM_CHECK(q.is_cuda(), "q must be a CUDA tensor, got one on ", q.device());
  BEM_CHECK(q.scalar_type() == at::kHalf || q.scalar_type() == at::kBFloat16 || q.scalar_type() == at::kFloat,
            "the mLSTM kernels take float16, bfloat16 or float32 q, k, v; got ", q.scalar_type());
}

void check_shape(const Tensor& t, const char* name, at::IntArrayRef expected, const char* what) {
  BEM_CHECK(t.sizes() == expected, "", name, " must be ", what, " = ", expected, ", got ", t.sizes());
}

void check_on(const Tensor& t, const char* name, const Tensor& q) { bem::check_on(t, name, q, "q"); }

void check_like_q(const Tensor& t, const char* name, const Tensor& q) {
  check_on(t, name, q);
  BEM_CHECK(t.scalar_type() == q.scalar_type(), "", name, " has dtype ", t.scalar_type(), " but q has ",
            q.scalar_type());
}

void check_float(const Tensor& t, const char* name, const Tensor& q, at::IntArrayRef expected, const char* what) {
  check_on(t, name, q);
  BEM_CHECK(t.scalar_type() == at::kFloat, "", name, " must be float32, got ", t.scalar_type());
  check_shape(t, name, expected, what);
}

// Gates: the dtype of q or float32; returns whether they are float32.
bool check_gates(const Tensor& igate, const Tensor& fgate, const Tensor& q, at::IntArrayRef expected,
                 const char* what) {
  const auto check_one = [&](const Tensor& t, const char* name) {
    check_on(t, name, q);
    check_shape(t, name, expected, what);
    BEM_CHECK(t.scalar_type() == q.scalar_type() || t.scalar_type() == at::kFloat, "", name,
              " must have q's dtype or float32, got ", t.scalar_type());
  };
  check_one(igate, "igate");
  check_one(fgate, "fgate");
  BEM_CHECK(igate.scalar_type() == fgate.scalar_type(), "igate has dtype ", igate.scalar_type(), " but fgate has ",
            fgate.scalar_type());
  return igate.scalar_type() == at::kFloat;
}

Dims check_sequence(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& igate, const Tensor& fgate) {
  check_kernel_dtype(q);
  BEM_CHECK(q.dim() == 4, "q must be 4-D (B, NH, S, DHQK), got shape ", q.sizes());
  const Dims d{q.size(0), q.size(1), q.size(2), q.size(3), v.dim() == 4 ? v.size(3) : 0};
  BEM_CHECK(d.B > 0 && d.NH > 0 && d.S > 0 && d.DK > 0, "q must have non-empty dimensions, got ", q.sizes());
  check_like_q(q, "q", q);
  check_like_q(k, "k", q);
  check_shape(k, "k", q.sizes(), "(B, NH, S, DHQK) like q");
  check_like_q(v, "v", q);
  BEM_CHECK(v.dim() == 4 && v.size(0) == d.B && v.size(1) == d.NH && v.size(2) == d.S && d.DV > 0,
            "v must be (B, NH, S, DHV) = (", d.B, ", ", d.NH, ", ", d.S, ", DHV), got ", v.sizes());
  check_gates(igate, fgate, q, {d.B, d.NH, d.S}, "(B, NH, S)");
  BEM_CHECK(d.B * d.NH <= 65535, "B * NH must be at most 65535 (the kernels' grid), got ", d.B * d.NH);
  BEM_CHECK(d.S < INT_MAX / 2 && d.DK < 65536 && d.DV < 65536, "sizes too large: q ", q.sizes(), ", v ", v.sizes());
  return d;
}

at::ScalarType state_dtype(const Tensor& q) { return q.scalar_type() == at::kBFloat16 ? at::kBFloat16 : at::kFloat; }

bool vec_ok(int64_t cols, const Tensor& t) { return cols * (int64_t)t.element_size() % 16 == 0 && aligned16(t.data_ptr()); }

MlstmShape make_shape(const Dims& d, const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& igate,
                      const Tensor* dh) {
  MlstmShape sh{};
  sh.BH = (int)(d.B * d.NH);
  sh.S = (int)d.S;
  sh.DK = (int)d.DK;
  sh.DV = (int)d.DV;
  sh.NC = (int)((d.S + kMlstmChunk - 1) / kMlstmChunk);
  sh.scale = (float)(1.0 / std::sqrt((double)d.DK));
  sh.gates_fp32 = igate.scalar_type() == at::kFloat;
  sh.vec_qk = vec_ok(d.DK, q) && vec_ok(d.DK, k);
  sh.vec_v = vec_ok(d.DV, v) && (dh == nullptr || vec_ok(d.DV, *dh));
  sh.vec_state = d.DV * (int64_t)c10::elementSize(state_dtype(q)) % 16 == 0;
  return sh;
}

// The state pass's width: 0 picks it by the shape (mlstm_state_cols); 16, 32 or 64 force it (for measuring).
int state_cols_for(int64_t requested, const Dims& d, const Tensor& q) {
  if (requested == 0) return mlstm_state_cols((int)(d.B * d.NH), (int)d.DK, (int)d.DV, num_sms(q.get_device()));
  BEM_CHECK(requested == 16 || requested == 32 || requested == 64, "state_cols must be 0, 16, 32 or 64, got ",
            requested);
  return (int)requested;
}

std::vector<Tensor> mlstm_forward(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& igate,
                                  const Tensor& fgate, const OptTensor& C0, const OptTensor& n0, const OptTensor& m0,
                                  int64_t state_cols) {
  const Dims d = check_sequence(q, k, v, igate, fgate);
  BEM_CHECK(C0.has_value() == n0.has_value() && C0.has_value() == m0.has_value(),
            "initial_state needs all of C, n and m, or none");
  if (C0.has_value()) {
    check_float(*C0, "initial_state C", q, {d.B, d.NH, d.DK, d.DV}, "(B, NH, DHQK, DHV)");
    check_float(*n0, "initial_state n", q, {d.B, d.NH, d.DK}, "(B, NH, DHQK)");
    check_float(*m0, "initial_state m", q, {d.B, d.NH}, "(B, NH)");
  }
  const c10::cuda::CUDAGuard guard(q.device());
  const MlstmShape sh = make_shape(d, q, k, v, igate, nullptr);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor C_states = at::empty({d.B, d.NH, sh.NC, d.DK, d.DV}, q.options().dtype(state_dtype(q)));
  Tensor n_states = at::empty({d.B, d.NH, sh.NC, d.DK}, f32);
  Tensor m_states = at::empty({d.B, d.NH, sh.NC + 1}, f32);
  Tensor C_last = at::empty({d.B, d.NH, d.DK, d.DV}, f32);
  Tensor n_last = at::empty({d.B, d.NH, d.DK}, f32);
  Tensor m_last = at::empty({d.B, d.NH}, f32);
  Tensor h = at::empty_like(v);
  Tensor m_tok = at::empty({d.B, d.NH, d.S}, f32);
  Tensor den_tok = at::empty({d.B, d.NH, d.S}, f32);

  MlstmStatesParams sp{};
  sp.shape = sh;
  sp.reverse = false;
  sp.state_cols = state_cols_for(state_cols, d, q);
  sp.keys = k.data_ptr();
  sp.values = v.data_ptr();
  sp.igate = igate.data_ptr();
  sp.fgate = fgate.data_ptr();
  sp.C_in = C0.has_value() ? C0->data_ptr<float>() : nullptr;
  sp.n_in = n0.has_value() ? n0->data_ptr<float>() : nullptr;
  sp.m_in = m0.has_value() ? m0->data_ptr<float>() : nullptr;
  sp.C_states = C_states.data_ptr();
  sp.n_states = n_states.data_ptr<float>();
  sp.m_states = m_states.data_ptr<float>();
  sp.C_out = C_last.data_ptr<float>();
  sp.n_out = n_last.data_ptr<float>();
  sp.m_out = m_last.data_ptr<float>();
  // the gates' scan of every chunk, in the precision the kernels form log weights in (double for float32)
  const auto gate_type = q.options().dtype(q.scalar_type() == at::kFloat ? at::kDouble : at::kFloat);
  Tensor a_tok = at::empty({d.B * d.NH, sh.NC, kMlstmChunk}, gate_type);
  Tensor chunk_gm = at::empty({d.B * d.NH, sh.NC, 2}, gate_type);
  sp.a_tok = a_tok.data_ptr();
  sp.chunk_gm = chunk_gm.data_ptr();
  const cudaStream_t stream = stream_now();
  C10_CUDA_CHECK(launch_mlstm_gate_scan(dtype_of(q), sp, stream));
  C10_CUDA_CHECK(launch_mlstm_states(dtype_of(q), sp, stream));

  MlstmOutputsParams op{};
  op.shape = sh;
  op.q = q.data_ptr();
  op.k = k.data_ptr();
  op.v = v.data_ptr();
  op.igate = igate.data_ptr();
  op.fgate = fgate.data_ptr();
  op.C_states = C_states.data_ptr();
  op.n_states = n_states.data_ptr<float>();
  op.m_states = m_states.data_ptr<float>();
  op.h = h.data_ptr();
  op.m_tok = m_tok.data_ptr<float>();
  op.den_tok = den_tok.data_ptr<float>();
  C10_CUDA_CHECK(launch_mlstm_outputs(dtype_of(q), op, stream));
  return {h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states};
}

std::vector<Tensor> mlstm_backward(const Tensor& dh, const Tensor& q, const Tensor& k, const Tensor& v,
                                   const Tensor& igate, const Tensor& fgate, const Tensor& m_tok,
                                   const Tensor& den_tok, const Tensor& beta, const Tensor& C_states,
                                   const Tensor& n_states, const Tensor& m_states, const OptTensor& dC_last,
                                   const OptTensor& dn_last, int64_t state_cols) {
  const Dims d = check_sequence(q, k, v, igate, fgate);
  check_like_q(dh, "dh", q);
  check_shape(dh, "dh", v.sizes(), "(B, NH, S, DHV) like v");
  const int64_t NC = (d.S + kMlstmChunk - 1) / kMlstmChunk;
  check_float(m_tok, "m_tok", q, {d.B, d.NH, d.S}, "(B, NH, S)");
  check_float(den_tok, "den_tok", q, {d.B, d.NH, d.S}, "(B, NH, S)");
  check_float(beta, "beta", q, {d.B, d.NH, d.S}, "(B, NH, S)");
  check_on(C_states, "C_states", q);
  BEM_CHECK(C_states.scalar_type() == state_dtype(q), "C_states must be ", state_dtype(q), ", got ",
            C_states.scalar_type());
  check_shape(C_states, "C_states", {d.B, d.NH, NC, d.DK, d.DV}, "(B, NH, NC, DHQK, DHV)");
  check_float(n_states, "n_states", q, {d.B, d.NH, NC, d.DK}, "(B, NH, NC, DHQK)");
  check_float(m_states, "m_states", q, {d.B, d.NH, NC + 1}, "(B, NH, NC + 1)");
  if (dC_last.has_value()) check_float(*dC_last, "dC_last", q, {d.B, d.NH, d.DK, d.DV}, "(B, NH, DHQK, DHV)");
  if (dn_last.has_value()) check_float(*dn_last, "dn_last", q, {d.B, d.NH, d.DK}, "(B, NH, DHQK)");
  const c10::cuda::CUDAGuard guard(q.device());
  const MlstmShape sh = make_shape(d, q, k, v, igate, &dh);
  const auto f32 = q.options().dtype(at::kFloat);
  Tensor R_states = at::empty_like(C_states);
  Tensor Rn_states = at::empty_like(n_states);
  Tensor dC0 = at::empty({d.B, d.NH, d.DK, d.DV}, f32);
  Tensor dn0 = at::empty({d.B, d.NH, d.DK}, f32);
  const cudaStream_t stream = stream_now();

  MlstmStatesParams sp{};
  sp.shape = sh;
  sp.reverse = true;
  sp.state_cols = state_cols_for(state_cols, d, q);
  sp.keys = q.data_ptr();
  sp.values = dh.data_ptr();
  sp.igate = igate.data_ptr();
  sp.fgate = fgate.data_ptr();
  sp.m_tok = m_tok.data_ptr<float>();
  sp.den_tok = den_tok.data_ptr<float>();
  sp.beta = beta.data_ptr<float>();
  sp.C_in = dC_last.has_value() ? dC_last->data_ptr<float>() : nullptr;
  sp.n_in = dn_last.has_value() ? dn_last->data_ptr<float>() : nullptr;
  sp.C_states = R_states.data_ptr();
  sp.n_states = Rn_states.data_ptr<float>();
  sp.m_states = const_cast<float*>(m_states.data_ptr<float>());  // read only in the reverse pass
  sp.C_out = dC0.data_ptr<float>();
  sp.n_out = dn0.data_ptr<float>();
  Tensor w_tok = at::empty({d.B * d.NH, NC, kMlstmChunk}, f32);
  Tensor wn_tok = at::empty_like(w_tok);
  Tensor decay = at::empty({d.B * d.NH, NC}, f32);
  sp.w_tok = w_tok.data_ptr<float>();
  sp.wn_tok = wn_tok.data_ptr<float>();
  sp.decay = decay.data_ptr<float>();
  C10_CUDA_CHECK(launch_mlstm_gate_scan(dtype_of(q), sp, stream));
  C10_CUDA_CHECK(launch_mlstm_states(dtype_of(q), sp, stream));

  Tensor dq = at::empty_like(q), dk = at::empty_like(k), dv = at::empty_like(v);
  const int64_t dk_tiles = (d.DK + 63) / 64;
  Tensor qdq = at::empty({dk_tiles, d.B, d.NH, d.S}, f32);
  Tensor kdk = at::empty({dk_tiles, d.B, d.NH, d.S}, f32);
  MlstmGradParams gp{};
  gp.shape = sh;
  gp.q = q.data_ptr();
  gp.k = k.data_ptr();
  gp.v = v.data_ptr();
  gp.dh = dh.data_ptr();
  gp.igate = igate.data_ptr();
  gp.fgate = fgate.data_ptr();
  gp.m_tok = m_tok.data_ptr<float>();
  gp.den_tok = den_tok.data_ptr<float>();
  gp.beta = beta.data_ptr<float>();
  gp.C_states = C_states.data_ptr();
  gp.n_states = n_states.data_ptr<float>();
  gp.m_states = m_states.data_ptr<float>();
  gp.R_states = R_states.data_ptr();
  gp.Rn_states = Rn_states.data_ptr<float>();
  gp.dq = dq.data_ptr();
  gp.dk = dk.data_ptr();
  gp.dv = dv.data_ptr();
  gp.qdq = qdq.data_ptr<float>();
  gp.kdk = kdk.data_ptr<float>();
  C10_CUDA_CHECK(launch_mlstm_grads(dtype_of(q), gp, stream));
  return {dq, dk, dv, qdq, kdk, dC0, dn0};
}

Tensor mlstm_beta(const Tensor& dh, const Tensor& h, const Tensor& m_tok, const Tensor& den_tok) {
  check_kernel_dtype(h);
  BEM_CHECK(h.dim() == 4 && h.numel() > 0, "h must be a non-empty 4-D (B, NH, S, DHV), got shape ", h.sizes());
  check_like_q(h, "h", h);
  check_like_q(dh, "dh", h);
  check_shape(dh, "dh", h.sizes(), "(B, NH, S, DHV) like h");
  check_float(m_tok, "m_tok", h, {h.size(0), h.size(1), h.size(2)}, "(B, NH, S)");
  check_float(den_tok, "den_tok", h, {h.size(0), h.size(1), h.size(2)}, "(B, NH, S)");
  BEM_CHECK(h.size(3) < INT_MAX, "DHV too large: h ", h.sizes());
  const c10::cuda::CUDAGuard guard(h.device());
  Tensor beta = at::empty_like(m_tok);
  MlstmBetaParams p{};
  p.rows = h.size(0) * h.size(1) * h.size(2);
  p.DV = (int)h.size(3);
  p.vec = vec_ok(p.DV, h) && vec_ok(p.DV, dh);
  p.dh = dh.data_ptr();
  p.h = h.data_ptr();
  p.m_tok = m_tok.data_ptr<float>();
  p.den_tok = den_tok.data_ptr<float>();
  p.beta = beta.data_ptr<float>();
  C10_CUDA_CHECK(launch_mlstm_beta(dtype_of(h), p, stream_now()));
  return beta;
}

std::vector<Tensor> mlstm_step(const Tensor& q, const Tensor& k, const Tensor& v, const Tensor& igate,
                               const Tensor& fgate, const Tensor& C, const Tensor& n, const Tensor& m) {
  check_kernel_dtype(q);
  BEM_CHECK(q.dim() == 3, "q must be 3-D (B, NH, DHQK) for one token per row, got shape ", q.sizes());
  const int64_t B = q.size(0), NH = q.size(1), DK = q.size(2);
  BEM_CHECK(B > 0 && NH > 0 && DK > 0, "q must have non-empty dimensions, got ", q.sizes());
  check_like_q(q, "q", q);
  check_like_q(k, "k", q);
  check_shape(k, "k", q.sizes(), "(B, NH, DHQK) like q");
  check_like_q(v, "v", q);
  BEM_CHECK(v.dim() == 3 && v.size(0) == B && v.size(1) == NH && v.size(2) > 0,
            "v must be (B, NH, DHV) = (", B, ", ", NH, ", DHV), got ", v.sizes());
  const int64_t DV = v.size(2);
  const bool gates_fp32 = check_gates(igate, fgate, q, {B, NH}, "(B, NH)");
  check_float(C, "state C", q, {B, NH, DK, DV}, "(B, NH, DHQK, DHV)");
  check_float(n, "state n", q, {B, NH, DK}, "(B, NH, DHQK)");
  check_float(m, "state m", q, {B, NH}, "(B, NH)");
  BEM_CHECK(B * NH < INT_MAX && DV <= 65535 * 32 && DK < INT_MAX / DV, "sizes too large: q ", q.sizes(), ", v ",
            v.sizes());
  const c10::cuda::CUDAGuard guard(q.device());
  Tensor h = at::empty_like(v), C_out = at::empty_like(C), n_out = at::empty_like(n), m_out = at::empty_like(m);
  MlstmStepParams p{};
  p.BH = (int)(B * NH);
  p.DK = (int)DK;
  p.DV = (int)DV;
  p.scale = (float)(1.0 / std::sqrt((double)DK));
  p.gates_fp32 = gates_fp32;
  p.q = q.data_ptr();
  p.k = k.data_ptr();
  p.v = v.data_ptr();
  p.igate = igate.data_ptr();
  p.fgate = fgate.data_ptr();
  p.C = C.data_ptr<float>();
  p.n = n.data_ptr<float>();
  p.m = m.data_ptr<float>();
  p.h = h.data_ptr();
  p.C_out = C_out.data_ptr<float>();
  p.n_out = n_out.data_ptr<float>();
  p.m_out = m_out.data_ptr<float>();
  C10_CUDA_CHECK(launch_mlstm_step(dtype_of(q), p, stream_now()));
  return {h, C_out, n_out, m_out};
}

}  // namespace

void bind_mlstm(pybind11::module_& m) {
  m.def("mlstm_forward", &mlstm_forward,
        "[h, C_last, n_last, m_last, m_tok, den_tok, C_states, n_states, m_states] of the chunkwise mLSTM",
        py::arg("q"), py::arg("k"), py::arg("v"), py::arg("igate"), py::arg("fgate"), py::arg("C0") = py::none(),
        py::arg("n0") = py::none(), py::arg("m0") = py::none(), py::arg("state_cols") = 0);
  m.def("mlstm_backward", &mlstm_backward,
        "[dq, dk, dv, qdq, kdk, dC0, dn0] of the chunkwise mLSTM (qdq, kdk: per 64-column tile of DHQK)",
        py::arg("dh"), py::arg("q"), py::arg("k"), py::arg("v"), py::arg("igate"), py::arg("fgate"),
        py::arg("m_tok"), py::arg("den_tok"), py::arg("beta"), py::arg("C_states"), py::arg("n_states"),
        py::arg("m_states"), py::arg("dC_last") = py::none(), py::arg("dn_last") = py::none(),
        py::arg("state_cols") = 0);
  m.def("mlstm_beta", &mlstm_beta, "beta (B, NH, S): the gradient of each token's stabilised denominator",
        py::arg("dh"), py::arg("h"), py::arg("m_tok"), py::arg("den_tok"));
  m.def("mlstm_step", &mlstm_step, "[h, C', n', m']: one mLSTM token per row from the float32 state", py::arg("q"),
        py::arg("k"), py::arg("v"), py::arg("igate"), py::arg("fgate"), py::arg("C"), py::arg("n"), py::arg("m"));
  m.attr("MLSTM_CHUNK") = kMlstmChunk;
}

}  // namespace bem
