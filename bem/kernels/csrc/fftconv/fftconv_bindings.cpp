// Torch bindings of the fftconv op family: every argument checked, naming the operand (ValueError, or
// TypeError for a dtype), before anything is allocated or launched; the choice between the block kernels
// (L <= 16384), the four-step form (up to 2^20, its host side in fftconv_tiled_ops.cpp) and cuFFT around the
// element-wise kernels (above); allocation; every launch checked.
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <algorithm>
#include <climits>
#include <stdexcept>
#include <vector>

#include "fftconv_host.h"

namespace bem {
namespace fftconv_host {
namespace {

// u: (B, H, L) on CUDA; k: (H, Lk); D: (H,); gates: u's shape and dtype; all contiguous, on u's device.
Shape check_operands(const Tensor& u, const Tensor& k, const OptTensor& D, const OptTensor& pregate,
                     const OptTensor& postgate) {
  FFTCONV_CHECK(u.is_cuda(), "u must be a CUDA tensor, got one on ", u.device());
  FFTCONV_CHECK(u.dim() == 3, "u must be 3-D (B, H, L), got shape ", u.sizes());
  Shape s{u.size(0), u.size(1), u.size(2), 0, 0, 0, dtype_of(u, "u")};
  check_on(u, "u", u);
  FFTCONV_CHECK(s.L >= 1 && s.L <= (int64_t)1 << 26, "u's length L must be in [1, 2^26], got ", s.L);
  FFTCONV_CHECK(s.B * s.H < INT_MAX, "B * H must be below 2^31, got ", s.B, " * ", s.H);
  dtype_of(k, "k");
  check_on(k, "k", u);
  FFTCONV_CHECK(k.dim() == 2 && k.size(0) == s.H && k.size(1) >= 1, "k must be (H, Lk) = (", s.H,
                ", Lk >= 1), got ", k.sizes());
  s.Lk = k.size(1);
  s.taps = std::min(s.Lk, s.L);
  s.M = fc::spectrum_length(s.L);
  if (D.has_value()) {
    dtype_of(*D, "D");
    check_on(*D, "D", u);
    FFTCONV_CHECK(D->dim() == 1 && D->size(0) == s.H, "D must be (H,) = (", s.H, ",), got ", D->sizes());
  }
  for (const auto& [gate, name] : {std::make_pair(&pregate, "pregate"), std::make_pair(&postgate, "postgate")}) {
    if (!gate->has_value()) continue;
    const Tensor& g = **gate;
    FFTCONV_CHECK_DTYPE(g.scalar_type() == u.scalar_type(), name, " has dtype ", g.scalar_type(), " but u has ",
                        u.scalar_type());
    check_on(g, name, u);
    FFTCONV_CHECK(g.sizes() == u.sizes(), name, " must have u's shape ", u.sizes(), ", got ", g.sizes());
  }
  return s;
}

OptTensor float32(const OptTensor& t) {
  if (!t.has_value()) return c10::nullopt;
  return t->scalar_type() == at::kFloat ? *t : t->to(at::kFloat);
}

// S = rfft(k[:, :taps], n = 2M): complex64 (H, M + 1); in the four-step order where that path runs (fftconv.h)
Tensor compute_spectrum(const Tensor& k, int64_t taps, int64_t M) {
  const int64_t H = k.size(0);
  const int device = k.get_device();
  if (tiled_path(M, device)) {
    Tensor S = at::empty({H, M + 1}, k.options().dtype(at::kComplexFloat));
    if (H == 0) return S;
    Tensor work = tiled_work(H, M, k);
    C10_CUDA_CHECK(fc::launch_tiled_columns(dtype_of(k, "k"), k.data_ptr(), nullptr, k.size(1), (int)taps, H,
                                            (int)M, f2(work), stream_now()));
    const fc::TiledRowsArgs rows{f2(work), f2(S), nullptr, nullptr, H, 1, (int)H, (int)M, false};
    C10_CUDA_CHECK(fc::launch_tiled_rows(fc::TiledRows::kSpectrum, rows, num_sms(device), stream_now()));
    return S;
  }
  if (block_path(M, k.get_device())) {
    Tensor S = at::empty({H, M + 1}, k.options().dtype(at::kComplexFloat));
    if (H == 0) return S;
    const fc::SpectrumArgs args{k.data_ptr(), dtype_of(k, "k"), reinterpret_cast<float2*>(S.data_ptr()), (int)H,
                                (int)k.size(1), (int)taps};
    C10_CUDA_CHECK(fc::launch_spectrum((int)M, args, num_sms(k.get_device()), stream_now()));
    return S;
  }
  Tensor padded = at::zeros({H, 2 * M}, k.options().dtype(at::kFloat));
  padded.narrow(1, 0, taps).copy_(k.narrow(1, 0, taps));
  return at::fft_rfft(padded, 2 * M, -1);
}

Tensor spectrum_for(const Tensor& k, const Shape& s, const OptTensor& given) {
  if (!given.has_value()) return compute_spectrum(k, s.taps, s.M);
  const Tensor& S = *given;
  FFTCONV_CHECK(S.device() == k.device(), "spectrum is on ", S.device(), " but k is on ", k.device());
  FFTCONV_CHECK_DTYPE(S.scalar_type() == at::kComplexFloat, "spectrum must be complex64, got ", S.scalar_type());
  FFTCONV_CHECK(S.dim() == 2 && S.size(0) == s.H && S.size(1) == s.M + 1 && S.is_contiguous(),
                "spectrum must be a contiguous (H, M + 1) = (", s.H, ", ", s.M + 1,
                ") tensor for this length, got ", S.sizes());
  return S;
}

Tensor fftconv_spectrum(const Tensor& k, int64_t L) {
  FFTCONV_CHECK(k.is_cuda(), "k must be a CUDA tensor, got one on ", k.device());
  dtype_of(k, "k");
  FFTCONV_CHECK(k.is_contiguous(), "k must be contiguous; got strides ", k.strides());
  FFTCONV_CHECK(k.dim() == 2 && k.size(1) >= 1, "k must be (H, Lk) with Lk >= 1, got ", k.sizes());
  FFTCONV_CHECK(L >= 1 && L <= (int64_t)1 << 26, "L must be in [1, 2^26], got ", L);
  const c10::cuda::CUDAGuard guard(k.device());
  return compute_spectrum(k, std::min<int64_t>(k.size(1), L), fc::spectrum_length(L));
}

// (y, S'): S' the spectrum this call computed where M <= kMaxBlockSpectrum (the backward reuses it), else
// empty (a spectrum was given, or it is too large to hold until the backward).
std::vector<Tensor> fftconv_forward(const Tensor& u, const Tensor& k, const OptTensor& D, const OptTensor& pregate,
                                    const OptTensor& postgate, bool gelu, const OptTensor& spectrum) {
  const Shape s = check_operands(u, k, D, pregate, postgate);
  const c10::cuda::CUDAGuard guard(u.device());
  Tensor y = at::empty_like(u);
  const bool keep = !spectrum.has_value() && s.M <= fc::kMaxBlockSpectrum;
  const auto complex64 = u.options().dtype(at::kComplexFloat);
  if (u.numel() == 0) return {y, keep ? at::zeros({s.H, s.M + 1}, complex64) : at::empty({0}, complex64)};
  const Tensor S = spectrum_for(k, s, spectrum);
  const Tensor kept = keep ? S : at::empty({0}, complex64);
  const OptTensor D32 = float32(D);
  if (tc_path(s.dtype, s.M, u.get_device())) {
    const fc::TcForwardArgs args{u.data_ptr(), ptr(pregate), ptr(postgate),
                                 reinterpret_cast<const float2*>(S.data_ptr()),
                                 D32.has_value() ? D32->data_ptr<float>() : nullptr,
                                 y.data_ptr(), (int)s.B, (int)s.H, (int)s.L, gelu, false};
    C10_CUDA_CHECK(fc::launch_tc_forward((int)s.M, args, num_sms(u.get_device()), stream_now()));
    return {y, kept};
  }
  if (block_path(s.M, u.get_device())) {
    const fc::ForwardArgs args{u.data_ptr(), ptr(pregate), ptr(postgate),
                               reinterpret_cast<const float2*>(S.data_ptr()),
                               D32.has_value() ? D32->data_ptr<float>() : nullptr,
                               y.data_ptr(), s.B * s.H, (int)s.H, (int)s.L, gelu};
    C10_CUDA_CHECK(fc::launch_forward(s.dtype, (int)s.M, args, num_sms(u.get_device()), stream_now()));
    return {y, kept};
  }
  fc::RowsArgs r = rows_args(s, u, pregate, postgate, D32, gelu);
  r.y = y.data_ptr();
  if (tiled_path(s.M, u.get_device())) {
    const Tensor work = tiled_convolve(s, u, pregate, S);
    C10_CUDA_CHECK(fc::launch_tiled_epilogue(s.dtype, f2(work), r, (int)s.M, stream_now()));
    return {y, kept};
  }
  // longer: cuFFT's transforms of the float32 padded rows; one element-wise pass before, one after
  const int64_t N = 2 * s.M;
  Tensor v = at::empty({r.rows, N}, u.options().dtype(at::kFloat));
  C10_CUDA_CHECK(fc::launch_pad_rows(s.dtype, u.data_ptr(), ptr(pregate), v.data_ptr<float>(), r, stream_now()));
  Tensor V = at::fft_rfft(v, N, -1);
  v.reset();
  V.view({s.B, s.H, s.M + 1}).mul_(S);
  const Tensor conv = at::fft_irfft(V, N, -1);
  V.reset();
  C10_CUDA_CHECK(fc::launch_forward_epilogue(s.dtype, conv.data_ptr<float>(), r, stream_now()));
  return {y, kept};
}

std::vector<Tensor> fftconv_backward(const Tensor& grad_y, const Tensor& u, const Tensor& k, const OptTensor& D,
                                     const OptTensor& pregate, const OptTensor& postgate, bool gelu,
                                     const OptTensor& spectrum, const std::vector<bool>& needs) {
  const Shape s = check_operands(u, k, D, pregate, postgate);
  FFTCONV_CHECK(needs.size() == 5, "needs must name 5 gradients (u, k, D, pregate, postgate), got ", needs.size());
  FFTCONV_CHECK_DTYPE(grad_y.scalar_type() == u.scalar_type(), "grad_y has dtype ", grad_y.scalar_type(),
                      " but u has ", u.scalar_type());
  check_on(grad_y, "grad_y", u);
  FFTCONV_CHECK(grad_y.sizes() == u.sizes(), "grad_y must have u's shape ", u.sizes(), ", got ", grad_y.sizes());
  const bool need_u = needs[0], need_k = needs[1], need_D = needs[2] && D.has_value();
  const bool need_pre = needs[3] && pregate.has_value(), need_post = needs[4] && postgate.has_value();
  const bool need_c = gelu || need_post;
  const c10::cuda::CUDAGuard guard(u.device());
  Tensor du = need_u ? at::empty_like(u) : Tensor();
  Tensor dpre = need_pre ? at::empty_like(u) : Tensor();
  Tensor dpost = need_post ? at::empty_like(u) : Tensor();
  Tensor dk, dD;
  // a gradient not asked for comes back empty; a fresh one each, since a custom op's outputs may not alias
  auto out = [&](const Tensor& t) { return t.defined() ? t : at::empty({0}, u.options()); };
  if (u.numel() == 0) {
    if (need_k) dk = at::zeros_like(k);
    if (need_D) dD = at::zeros_like(*D);
    return {out(du), out(dk), out(dD), out(dpre), out(dpost)};
  }
  const Tensor S = spectrum_for(k, s, spectrum);
  const OptTensor D32 = float32(D);
  const int sms = num_sms(u.get_device());
  auto f32 = [](Tensor& t) { return t.defined() ? t.data_ptr<float>() : nullptr; };
  if (tc_backward_takes(s.dtype, s.M, gelu, need_k, u.get_device())) {
    // Every gradient from the tensor-core kernels, their operand slots filled from dy, u and the gates, with
    // g = dy ⊙ postgate and v = u ⊙ pregate: dv = corr(g, k) + D g is the correlation with dy in u's slot and the
    // post-gate in the pre-gate's; du = pregate ⊙ dv and dpregate = u ⊙ dv come through its post-gate slot;
    // dpostgate = dy ⊙ (conv(v, k) + D v) is the forward with dy as its post-gate; dk and dD are the
    // filter-gradient kernel's.
    const auto* S2 = reinterpret_cast<const float2*>(S.data_ptr());
    const float* Dp = D32.has_value() ? D32->data_ptr<float>() : nullptr;
    auto transform = [&](const void* a, const void* pre, const void* post, Tensor& out, bool correlate) {
      const fc::TcForwardArgs tc{a, pre, post, S2, Dp, out.data_ptr(), (int)s.B, (int)s.H, (int)s.L, false, correlate};
      C10_CUDA_CHECK(fc::launch_tc_forward((int)s.M, tc, sms, stream_now()));
    };
    if (need_u) transform(grad_y.data_ptr(), ptr(postgate), ptr(pregate), du, true);
    if (need_pre) transform(grad_y.data_ptr(), ptr(postgate), u.data_ptr(), dpre, true);
    if (need_post) transform(u.data_ptr(), ptr(pregate), grad_y.data_ptr(), dpost, false);
    if (need_k) {
      // the tensor-core filter gradient: dk itself where a head's rows are one chunk, else a share per chunk
      const fc::TcFilterGradPlan plan = fc::tc_filter_grad_plan((int)s.M, (int)s.B, (int)s.H, sms);
      FFTCONV_CHECK(plan.grid > 0, "the tensor-core filter-gradient kernel does not fit this GPU");
      const auto f32_options = u.options().dtype(at::kFloat);
      Tensor table = at::empty({std::max<int64_t>(plan.table_words, 1)}, u.options().dtype(at::kInt));
      Tensor dk_part = plan.chunks == 1 ? Tensor() : at::empty({s.H, plan.chunks, s.taps}, f32_options);
      if (plan.chunks == 1) dk = at::empty_like(k);
      Tensor dD_part = need_D ? at::empty({s.H, plan.dD_per_head}, f32_options) : Tensor();  // dD comes with dk
      const fc::TcFilterGradArgs tc{grad_y.data_ptr(), ptr(postgate), u.data_ptr(), ptr(pregate),
                                    plan.chunks == 1 ? dk.data_ptr() : nullptr, f32(dk_part), f32(dD_part),
                                    reinterpret_cast<uint32_t*>(table.data_ptr()), (int)s.B, (int)s.H, (int)s.L,
                                    (int)s.Lk, (int)s.taps, dtype_of(k, "k")};
      C10_CUDA_CHECK(fc::launch_tc_filter_grad((int)s.M, tc, plan, stream_now()));
      if (plan.chunks != 1) dk = dk_of(dk_part.sum(1), k);
      if (need_D) dD = dD_part.sum(1).to(D->scalar_type());
    }
    if (need_D && !need_k) {
      fc::RowsArgs r = rows_args(s, u, pregate, postgate, D32, false);
      r.dy = grad_y.data_ptr();
      dD = dD_sum(s, r, nullptr, 0, *D);
    }
    return {out(du), out(dk), out(dD), out(dpre), out(dpost)};
  }
  if (block_path(s.M, u.get_device())) {
    fc::BackwardArgs args{};
    args.dy = grad_y.data_ptr();
    args.u = u.data_ptr();
    args.pregate = ptr(pregate);
    args.postgate = ptr(postgate);
    args.S = reinterpret_cast<const float2*>(S.data_ptr());
    args.D = D32.has_value() ? D32->data_ptr<float>() : nullptr;
    args.B = (int)s.B;
    args.H = (int)s.H;
    args.L = (int)s.L;
    args.taps = (int)s.taps;
    args.gelu = gelu;
    // Up to three launches, each kernel the code of two transforms a row (fftconv_pass.h): with GELU or
    // dpostgate wanted, the pre-activation again and from it g (float32, to g_rows) and dpostgate; the input
    // gradients (one block per (b, h) row); dk (a block per (h, group of batch rows), summing G conj(V) over
    // the group).
    const bool inputs_wanted = need_u || need_pre || need_D;
    Tensor g_rows;
    if (need_c) {
      g_rows = at::empty({s.B, s.H, s.L}, u.options().dtype(at::kFloat));
      args.pass = fc::BackwardPass::kActivation;
      args.groups = (int)s.B;
      args.rows_per_group = 1;
      args.g_rows = g_rows.data_ptr<float>();
      args.dpostgate = need_post ? dpost.data_ptr() : nullptr;
      const int blocks = fc::backward_blocks(s.dtype, (int)s.M, s.H * s.B, sms, args.pass, true);
      FFTCONV_CHECK(blocks > 0, "the backward kernel does not fit this GPU");
      C10_CUDA_CHECK(fc::launch_backward(s.dtype, (int)s.M, args, blocks, stream_now()));
      args.dpostgate = nullptr;
    }
    if (inputs_wanted) {
      args.pass = fc::BackwardPass::kInputs;
      args.groups = (int)s.B;
      args.rows_per_group = 1;
      const int blocks = fc::backward_blocks(s.dtype, (int)s.M, s.H * s.B, sms, args.pass, need_c);
      FFTCONV_CHECK(blocks > 0, "the backward kernel does not fit this GPU");
      Tensor dD_part = need_D ? at::empty({s.H, s.B}, u.options().dtype(at::kFloat)) : Tensor();
      args.du = need_u ? du.data_ptr() : nullptr;
      args.dpregate = need_pre ? dpre.data_ptr() : nullptr;
      args.dD_part = f32(dD_part);
      C10_CUDA_CHECK(fc::launch_backward(s.dtype, (int)s.M, args, blocks, stream_now()));
      if (need_D) dD = dD_part.sum(1).to(D->scalar_type());
      args.du = args.dpregate = nullptr;
      args.dD_part = nullptr;
    }
    if (need_k) {
      args.pass = fc::BackwardPass::kFilter;
      // a block per (h, group of batch rows): as many groups as fill the GPU once, the groups' dk summed after
      const int full = fc::backward_blocks(s.dtype, (int)s.M, INT_MAX, sms, args.pass, need_c);
      FFTCONV_CHECK(full > 0, "the backward kernel does not fit this GPU");
      const int64_t wanted = std::min<int64_t>(s.B, std::max<int64_t>(1, (full + s.H - 1) / s.H));
      const int64_t rows_per_group = (s.B + wanted - 1) / wanted;
      const int64_t groups = (s.B + rows_per_group - 1) / rows_per_group;
      const int blocks = fc::backward_blocks(s.dtype, (int)s.M, s.H * groups, sms, args.pass, need_c);
      Tensor scratch = at::empty({blocks * fc::backward_scratch_per_block((int)s.M)}, u.options().dtype(at::kFloat));
      Tensor dk_part = at::empty({s.H, groups, s.taps}, u.options().dtype(at::kFloat));
      args.dk_part = f32(dk_part);
      args.scratch = f32(scratch);
      args.groups = (int)groups;
      args.rows_per_group = (int)rows_per_group;
      C10_CUDA_CHECK(fc::launch_backward(s.dtype, (int)s.M, args, blocks, stream_now()));
      dk = dk_of(dk_part.sum(1), k);
    }
    return {out(du), out(dk), out(dD), out(dpre), out(dpost)};
  }
  fc::RowsArgs r = rows_args(s, u, pregate, postgate, D32, gelu);
  r.dy = grad_y.data_ptr();
  r.du = need_u ? du.data_ptr() : nullptr;
  r.dpregate = need_pre ? dpre.data_ptr() : nullptr;
  r.dpostgate = need_post ? dpost.data_ptr() : nullptr;
  if (tiled_path(s.M, u.get_device())) {
    tiled_backward(s, u, grad_y, pregate, postgate, D, S, r, need_c, need_u || need_pre, need_k, need_D, k, dk, dD);
    return {out(du), out(dk), out(dD), out(dpre), out(dpost)};
  }
  // longer: cuFFT; V = FFT(v) and G = FFT(g) give dk = IFFT(sum_b G conj V) and dv = IFFT(G conj S), with S
  // in the natural order
  const Tensor S_natural = natural_spectrum(S, s.M, u.get_device());
  const int64_t N = 2 * s.M;
  const auto rows3 = std::vector<int64_t>{s.B, s.H, s.M + 1};
  Tensor v = at::empty({r.rows, N}, u.options().dtype(at::kFloat));
  C10_CUDA_CHECK(fc::launch_pad_rows(s.dtype, u.data_ptr(), ptr(pregate), v.data_ptr<float>(), r, stream_now()));
  Tensor V = at::fft_rfft(v, N, -1);
  Tensor g = at::empty({r.rows, N}, u.options().dtype(at::kFloat));
  if (need_c) {
    const Tensor conv = at::fft_irfft(V.view(rows3).mul(S_natural).view({r.rows, s.M + 1}), N, -1);
    C10_CUDA_CHECK(fc::launch_activation_backward(s.dtype, conv.data_ptr<float>(), g.data_ptr<float>(), r,
                                                  stream_now()));
  } else {
    C10_CUDA_CHECK(fc::launch_pad_rows(s.dtype, grad_y.data_ptr(), ptr(postgate), g.data_ptr<float>(), r,
                                       stream_now()));
  }
  if (need_D) dD = dD_sum(s, r, g.data_ptr<float>(), N, *D);
  v.reset();
  Tensor G = at::fft_rfft(g, N, -1);
  if (need_k) {
    const Tensor product = (G.view(rows3) * V.view(rows3).conj()).sum(0);
    dk = dk_of(at::fft_irfft(product, N, -1).narrow(1, 0, s.taps), k);
  }
  V.reset();
  if (need_u || need_pre) {
    G.view(rows3).mul_(S_natural.conj());
    const Tensor corr = at::fft_irfft(G, N, -1);
    G.reset();
    C10_CUDA_CHECK(fc::launch_input_grads(s.dtype, corr.data_ptr<float>(), g.data_ptr<float>(), r, stream_now()));
  }
  return {out(du), out(dk), out(dD), out(dpre), out(dpost)};
}

Tensor fftconv_step(const Tensor& history, const Tensor& u_t, const Tensor& k, const OptTensor& position,
                    int64_t position_value, const OptTensor& D, const OptTensor& pregate, const OptTensor& postgate,
                    bool gelu) {
  FFTCONV_CHECK(u_t.is_cuda(), "u_t must be a CUDA tensor, got one on ", u_t.device());
  FFTCONV_CHECK(u_t.dim() == 2, "u_t must be 2-D (B, H), got shape ", u_t.sizes());
  const fc::Dtype dtype = dtype_of(u_t, "u_t");
  check_on(u_t, "u_t", u_t);
  const int64_t B = u_t.size(0), H = u_t.size(1);
  FFTCONV_CHECK(B * H < INT_MAX, "B * H must be below 2^31, got ", B, " * ", H);
  FFTCONV_CHECK_DTYPE(history.scalar_type() == u_t.scalar_type(), "history has dtype ", history.scalar_type(),
                      " but u_t has ", u_t.scalar_type());
  check_on(history, "history", u_t);
  FFTCONV_CHECK(history.dim() == 3 && history.size(0) == B && history.size(1) == H && history.size(2) >= 1 &&
                    history.size(2) < INT_MAX,
                "history must be (B, H, Lmax) = (", B, ", ", H, ", Lmax >= 1), got ", history.sizes());
  const fc::Dtype k_dtype = dtype_of(k, "k");
  check_on(k, "k", u_t);
  FFTCONV_CHECK(k.dim() == 2 && k.size(0) == H && k.size(1) >= 1 && k.size(1) < INT_MAX,
                "k must be (H, Lk) = (", H, ", Lk >= 1), got ", k.sizes());
  if (D.has_value()) {
    dtype_of(*D, "D");
    check_on(*D, "D", u_t);
    FFTCONV_CHECK(D->dim() == 1 && D->size(0) == H, "D must be (H,) = (", H, ",), got ", D->sizes());
  }
  for (const auto& [gate, name] : {std::make_pair(&pregate, "pregate"), std::make_pair(&postgate, "postgate")}) {
    if (!gate->has_value()) continue;
    FFTCONV_CHECK_DTYPE((*gate)->scalar_type() == u_t.scalar_type(), name, " has dtype ",
                        (*gate)->scalar_type(), " but u_t has ", u_t.scalar_type());
    check_on(**gate, name, u_t);
    FFTCONV_CHECK((*gate)->sizes() == u_t.sizes(), name, " must be (B, H) = (", B, ", ", H, "), got ",
                  (*gate)->sizes());
  }
  if (position.has_value()) {
    FFTCONV_CHECK_DTYPE(position->scalar_type() == at::kLong && position->dim() == 0,
                        "position must be a 0-d int64 tensor, got ", position->scalar_type(), " of shape ",
                        position->sizes());
    FFTCONV_CHECK(position->device() == u_t.device(), "position is on ", position->device(), " but u_t is on ",
                  u_t.device());
  } else {
    FFTCONV_CHECK(position_value >= 0 && position_value < history.size(2), "position must be in [0, ",
                  history.size(2), ") (the history's length), got ", position_value);
  }
  const c10::cuda::CUDAGuard guard(u_t.device());
  Tensor y = at::empty_like(u_t);
  const OptTensor D32 = float32(D);
  fc::StepArgs args{};
  args.history = history.data_ptr();
  args.u = u_t.data_ptr();
  args.pregate = ptr(pregate);
  args.postgate = ptr(postgate);
  args.k = k.data_ptr();
  args.D = D32.has_value() ? D32->data_ptr<float>() : nullptr;
  args.position = position.has_value() ? position->data_ptr<int64_t>() : nullptr;
  args.y = y.data_ptr();
  args.position_value = position_value;
  args.rows = (int)(B * H);
  args.H = (int)H;
  args.Lmax = (int)history.size(2);
  args.Lk = (int)k.size(1);
  args.gelu = gelu;
  C10_CUDA_CHECK(fc::launch_step(dtype, k_dtype, args, stream_now()));
  return y;
}

}  // namespace
}  // namespace fftconv_host

void bind_fftconv(pybind11::module_& m) {
  namespace py = pybind11;
  namespace fc = fftconv;
  using namespace fftconv_host;
  m.def("fftconv_spectrum", &fftconv_spectrum,
        "S = rfft(k[:, :L], n = 2M), complex64 (H, M + 1), in the order the forward reads (fftconv.h)", py::arg("k"),
        py::arg("L"));
  m.def("fftconv_forward", &fftconv_forward,
        "(y, S'): y = postgate ⊙ act(conv(pregate ⊙ u, k) + D ⊙ pregate ⊙ u), causal; spectrum: S of "
        "fftconv_spectrum or None; S' the spectrum computed here (M <= 16384) or empty",
        py::arg("u"), py::arg("k"), py::arg("D"), py::arg("pregate"), py::arg("postgate"), py::arg("gelu"),
        py::arg("spectrum"));
  m.def("fftconv_backward", &fftconv_backward,
        "(du, dk, dD, dpregate, dpostgate); needs: which of the five, the others empty", py::arg("grad_y"),
        py::arg("u"), py::arg("k"), py::arg("D"), py::arg("pregate"), py::arg("postgate"), py::arg("gelu"),
        py::arg("spectrum"), py::arg("needs"));
  m.def("fftconv_step", &fftconv_step,
        "one decoding step: history[:, :, p] = pregate ⊙ u_t in place; returns y_t (B, H)", py::arg("history"),
        py::arg("u_t"), py::arg("k"), py::arg("position"), py::arg("position_value"), py::arg("D"),
        py::arg("pregate"), py::arg("postgate"), py::arg("gelu"));
  m.attr("FFTCONV_MAX_BLOCK_LENGTH") = fc::kMaxBlockSpectrum;
  m.attr("FFTCONV_TILED_ROW_LENGTH") = fc::kTiledRowLength;
}

}  // namespace bem
