// The host side of the four-step form (16384 < M <= 2^20, fftconv_tiled.cu), forward and backward, and the
// element-wise passes' arguments it shares with the cuFFT path: allocation and every launch checked. The bindings
// (fftconv_bindings.cpp) check the operands and choose the path.
#include <c10/cuda/CUDAException.h>

#include <algorithm>

#include "fftconv_host.h"

namespace bem {
namespace fftconv_host {
namespace {

int log2_of(int64_t power_of_two) {
  int bits = 0;
  while (((int64_t)1 << bits) < power_of_two) ++bits;
  return bits;
}

}  // namespace

fc::RowsArgs rows_args(const Shape& s, const Tensor& u, const OptTensor& pregate, const OptTensor& postgate,
                       const OptTensor& D32, bool gelu) {
  fc::RowsArgs r{};
  r.u = u.data_ptr();
  r.pregate = ptr(pregate);
  r.postgate = ptr(postgate);
  r.D = D32.has_value() ? D32->data_ptr<float>() : nullptr;
  r.rows = s.B * s.H;
  r.H = (int)s.H;
  r.L = (int)s.L;
  r.log2_padded = log2_of(2 * s.M);
  r.gelu = gelu;
  return r;
}

Tensor dk_of(const Tensor& correlation, const Tensor& k) {
  if (correlation.size(1) == k.size(1)) return correlation.to(k.scalar_type());
  Tensor dk = at::zeros_like(k);
  dk.narrow(1, 0, correlation.size(1)).copy_(correlation);
  return dk;
}

Tensor natural_spectrum(const Tensor& S, int64_t M, int device) {
  if (!tiled_path(M, device)) return S;
  const int64_t H = S.size(0), M2 = fc::kTiledRowLength;
  return at::cat({S.narrow(1, 0, M).view({H, M / M2, M2}).transpose(1, 2).reshape({H, M}), S.narrow(1, M, 1)}, 1);
}

Tensor tiled_convolve(const Shape& s, const Tensor& u, const OptTensor& pregate, const Tensor& S) {
  const int64_t rows = s.B * s.H;
  Tensor work = tiled_work(rows, s.M, u);
  C10_CUDA_CHECK(fc::launch_tiled_columns(s.dtype, u.data_ptr(), ptr(pregate), s.L, (int)s.L, rows, (int)s.M,
                                          f2(work), stream_now()));
  const fc::TiledRowsArgs args{f2(work), f2(S), nullptr, nullptr, rows, (int)s.B, (int)s.H, (int)s.M, false};
  C10_CUDA_CHECK(fc::launch_tiled_rows(fc::TiledRows::kConv, args, num_sms(u.get_device()), stream_now()));
  return work;
}

Tensor dD_sum(const Shape& s, const fc::RowsArgs& r, const float* g_rows, int64_t g_stride, const Tensor& D) {
  const int chunks = (int)std::min<int64_t>(32, (s.L + 4095) / 4096);
  Tensor part = at::empty({s.B, s.H, chunks}, D.options().dtype(at::kDouble));
  C10_CUDA_CHECK(fc::launch_dD_parts(s.dtype, g_rows, g_stride, r, part.data_ptr<double>(), chunks, stream_now()));
  return part.sum(at::IntArrayRef{0, 2}).to(D.scalar_type());
}

void tiled_backward(const Shape& s, const Tensor& u, const Tensor& grad_y, const OptTensor& pregate,
                    const OptTensor& postgate, const OptTensor& D, const Tensor& S, const fc::RowsArgs& r,
                    bool need_c, bool need_inputs, bool need_k, bool need_D, const Tensor& k, Tensor& dk,
                    Tensor& dD) {
  const int M = (int)s.M, sms = num_sms(u.get_device());
  const int64_t rows = r.rows, padded = 2 * s.M;
  const auto f32 = u.options().dtype(at::kFloat);
  Tensor work_g;
  Tensor g;  // float32 rows of 2M, from the activation pass
  if (need_c) {  // c again through the forward's passes, then g (and dpostgate) from it
    work_g = tiled_convolve(s, u, pregate, S);
    Tensor c = at::empty({rows, padded}, f32);
    C10_CUDA_CHECK(fc::launch_tiled_conv(f2(work_g), c.data_ptr<float>(), padded, rows, (int)s.L, M, stream_now()));
    g = at::empty({rows, padded}, f32);
    C10_CUDA_CHECK(fc::launch_activation_backward(s.dtype, c.data_ptr<float>(), g.data_ptr<float>(), r,
                                                  stream_now()));
    c.reset();
    C10_CUDA_CHECK(fc::launch_tiled_columns(fc::Dtype::kFloat, g.data_ptr(), nullptr, padded, (int)s.L, rows, M,
                                            f2(work_g), stream_now()));
  } else {
    work_g = tiled_work(rows, s.M, u);
    C10_CUDA_CHECK(fc::launch_tiled_columns(s.dtype, grad_y.data_ptr(), ptr(postgate), s.L, (int)s.L, rows, M,
                                            f2(work_g), stream_now()));
  }
  if (need_D) dD = dD_sum(s, r, need_c ? g.data_ptr<float>() : nullptr, padded, *D);
  if (!need_inputs && !need_k) return;
  Tensor work_v, acc;
  if (need_k) {
    work_v = tiled_work(rows, s.M, u);
    C10_CUDA_CHECK(fc::launch_tiled_columns(s.dtype, u.data_ptr(), ptr(pregate), s.L, (int)s.L, rows, M,
                                            f2(work_v), stream_now()));
    acc = tiled_work(s.H, s.M, u);
  }
  const fc::TiledRowsArgs grad{f2(work_g), f2(S), need_k ? f2(work_v) : nullptr, need_k ? f2(acc) : nullptr,
                               rows, (int)s.B, (int)s.H, M, need_inputs};
  C10_CUDA_CHECK(fc::launch_tiled_rows(fc::TiledRows::kGrad, grad, sms, stream_now()));
  work_v.reset();
  if (need_inputs) {
    C10_CUDA_CHECK(fc::launch_tiled_input_grads(s.dtype, f2(work_g), r, need_c ? g.data_ptr<float>() : nullptr,
                                                padded, M, stream_now()));
  }
  if (need_k) {
    const fc::TiledRowsArgs inverse{f2(acc), nullptr, nullptr, nullptr, s.H, (int)s.B, (int)s.H, M, false};
    C10_CUDA_CHECK(fc::launch_tiled_rows(fc::TiledRows::kCorrInverse, inverse, sms, stream_now()));
    Tensor dk_part = at::empty({s.H, s.taps}, f32);
    C10_CUDA_CHECK(fc::launch_tiled_correlation(f2(acc), dk_part.data_ptr<float>(), (int)s.H, (int)s.taps, M,
                                                stream_now()));
    dk = dk_of(dk_part, k);
  }
}

}  // namespace fftconv_host
}  // namespace bem
