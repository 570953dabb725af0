// What the fftconv kernels do with a row around the block FFT (fftconv_block.cuh): the bin-wise ops of the
// pairing (the filter's spectrum, the convolution, the backward's products), the epilogues that turn a
// transform's output into the outputs and gradients (fetching their global inputs in groups), and the kernels'
// bodies: the spectrum, the forward, and the backward's passes (fftconv_pass.h). Kept free of torch headers,
// like fftconv_block.cuh.
#pragma once

#include "fftconv_block.cuh"
#include "fftconv_pass.h"

namespace bem {
namespace fftconv {

// ---------------------------------------------------------------------------------------------------
// the bin-wise ops

// The members of an op or store that reads nothing from global memory (besides an op's staged values).
struct NoInputs {};
#define BEM_FFT_FETCHES_NOTHING                                \
  using Inputs = NoInputs;                                     \
  static constexpr int kFetchGroup = 1;                        \
  BEM_FFT_FN NoInputs fetch(int) const { return {}; }          \
  BEM_FFT_FN NoInputs fetch(int, int) const { return {}; }     \
  BEM_FFT_FN void prefetch(int, int) const {}

// S[k] = X[k]: the spectrum kernel's output
struct SpectrumOp {
  BEM_FFT_FETCHES_NOTHING
  static constexpr bool kRetangle = false, kStaged = false;
  const float2* staged;
  float2* S;
  BEM_FFT_FN void operator()(int k, int kp, float2 Xk, float2 Xkp, float2, float2, NoInputs, float2&,
                             float2&) const {
    S[k] = cscale(Xk, 0.5f);
    S[kp] = cscale(Xkp, 0.5f);
  }
};

// Y = X S (the convolution; S staged)
struct ConvOp {
  BEM_FFT_FETCHES_NOTHING
  static constexpr bool kRetangle = true, kStaged = true;
  const float2* staged;  // S
  BEM_FFT_FN void operator()(int, int, float2 Xk, float2 Xkp, float2 Sk, float2 Skp, NoInputs, float2& Yk,
                             float2& Ykp) const {
    Yk = cmul(Xk, Sk);
    Ykp = cmul(Xkp, Skp);
  }
};

// keep X only (the filter's pass: V)
struct KeepOp {
  BEM_FFT_FETCHES_NOTHING
  static constexpr bool kRetangle = false, kStaged = false;
  const float2* staged;
  float2* keep;
  BEM_FFT_FN void operator()(int k, int kp, float2 Xk, float2 Xkp, float2, float2, NoInputs, float2&,
                             float2&) const {
    keep[k] = Xk;
    keep[kp] = Xkp;
  }
};

// the inputs' pass on G = FFT(g): Y = G conj(S) (dv; S staged)
struct GradOp {
  BEM_FFT_FETCHES_NOTHING
  static constexpr bool kRetangle = true, kStaged = true;
  const float2* staged;  // S
  BEM_FFT_FN void operator()(int, int, float2 Gk, float2 Gkp, float2 Sk, float2 Skp, NoInputs, float2& Yk,
                             float2& Ykp) const {
    Yk = cmulc(Gk, Sk);
    Ykp = cmulc(Gkp, Skp);
  }
};

// the filter's pass on G = FFT(g): acc (+)= G conj(V), no inverse after it. V and acc are the block's scratch
// in global memory, prefetched into L2 before the last pass and fetched a pair at a time (two spilled).
struct FilterGradOp {
  static constexpr bool kRetangle = false, kStaged = false;
  static constexpr int kFetchGroup = 1;
  struct Inputs {
    float2 Vk, Vkp, acc_k, acc_kp;
  };
  const float2* staged;
  const float2* V;  // null: nothing fetched (no dk asked for)
  float2* acc;
  bool first;  // the group's first row: acc is written, not read
  BEM_FFT_FN void prefetch(int k1, int k2) const {
    if (!V) return;
    prefetch_l2(V + k1);
    prefetch_l2(V + k2);
    if (!first) {
      prefetch_l2(acc + k1);
      prefetch_l2(acc + k2);
    }
  }
  BEM_FFT_FN Inputs fetch(int k, int kp) const {
    const float2 zero = make_float2(0.0f, 0.0f);
    Inputs in{zero, zero, zero, zero};
    if (V) {
      in.Vk = V[k];
      in.Vkp = V[kp];
      if (!first) {
        in.acc_k = acc[k];
        in.acc_kp = acc[kp];
      }
    }
    return in;
  }
  BEM_FFT_FN void operator()(int k, int kp, float2 Gk, float2 Gkp, float2, float2, const Inputs& in, float2&,
                             float2&) const {
    const float2 ck = cmulc(Gk, in.Vk), ckp = cmulc(Gkp, in.Vkp);
    acc[k] = first ? ck : cadd(in.acc_k, ck);
    if (kp != k) acc[kp] = first ? ckp : cadd(in.acc_kp, ckp);
  }
};

// Y = acc (the correlation's spectrum, for dk)
struct AccumulatedOp {
  static constexpr bool kRetangle = true, kStaged = false;
  static constexpr int kFetchGroup = 4;
  struct Inputs {
    float2 k, kp;
  };
  const float2* staged;
  const float2* acc;
  BEM_FFT_FN void prefetch(int, int) const {}
  BEM_FFT_FN Inputs fetch(int k, int kp) const { return Inputs{acc[k], acc[kp]}; }
  BEM_FFT_FN void operator()(int, int, float2, float2, float2, float2, const Inputs& in, float2& Yk,
                             float2& Ykp) const {
    Yk = in.k;
    Ykp = in.kp;
  }
};

// ---------------------------------------------------------------------------------------------------
// the epilogues: in = fetch(n) loads the global inputs of the outputs 2n and 2n+1 (last_pass issues a group's
// fetches before its stores), then store(n, z, in), z = (c[2n], c[2n+1]) times 1/scale

template <typename T>
struct ForwardStore {
  static constexpr bool kWritesSmem = false;
  static constexpr int kFetchGroup = 8;
  struct Inputs {
    float v[2], post[2];
  };
  GatedLoad<T> v;  // D ⊙ v: the pregated input read again (a recent row: L2)
  T* y;
  const T* post;
  float D;
  bool with_d;
  float scale;
  bool gelu;
  BEM_FFT_FN Inputs fetch(int n) const {
    Inputs in;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 2 * n + e;
      in.v[e] = with_d ? v.value(m) : 0.0f;
      in.post[e] = post && m < v.L ? to_f(post[m]) : 1.0f;
    }
    return in;
  }
  BEM_FFT_FN void one(int m, float c, const Inputs& in, int e) const {
    if (m >= v.L) return;
    if (with_d) c += D * in.v[e];
    float a = gelu ? gelu_f(c) : c;
    if (post) a *= in.post[e];
    y[m] = from_f<T>(a);
  }
  BEM_FFT_FN double operator()(int n, float2 z, const Inputs& in) const {
    one(2 * n, z.x * scale, in, 0);
    one(2 * n + 1, z.y * scale, in, 1);
    return 0.0;
  }
};

// From the recomputed pre-activation c = conv + D ⊙ v: dpost = dy ⊙ act(c); g = dy ⊙ post ⊙ act'(c) into
// buf (zero past L) and, when D is given, into g_keep for the input gradients' D ⊙ g.
template <int M, typename T>
struct ActivationGradStore {
  static constexpr bool kWritesSmem = true;
  static constexpr int kFetchGroup = 4;
  struct Inputs {
    float v[2], dy[2], post[2];
  };
  const BlockFft<M>* fft;
  GatedLoad<T> v;
  const T* dy;
  const T* post;
  T* dpost;
  float* g_keep;  // where g goes besides buf, or null
  float D;
  bool with_d;
  float scale;
  bool gelu;
  BEM_FFT_FN Inputs fetch(int n) const {
    Inputs in;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 2 * n + e;
      const bool inside = m < v.L;
      in.v[e] = with_d ? v.value(m) : 0.0f;
      in.dy[e] = inside ? to_f(dy[m]) : 0.0f;
      in.post[e] = post && inside ? to_f(post[m]) : 1.0f;
    }
    return in;
  }
  BEM_FFT_FN float one(int m, float c, const Inputs& in, int e) const {
    if (m >= v.L) return 0.0f;
    if (with_d) c += D * in.v[e];
    const float dyv = in.dy[e];
    if (dpost) dpost[m] = from_f<T>(dyv * (gelu ? gelu_f(c) : c));
    float g = post ? dyv * in.post[e] : dyv;
    if (gelu) g *= gelu_grad_f(c);
    if (g_keep) g_keep[m] = g;
    return g;
  }
  BEM_FFT_FN double operator()(int n, float2 z, const Inputs& in) const {
    fft->st(n, make_float2(one(2 * n, z.x * scale, in, 0), one(2 * n + 1, z.y * scale, in, 1)));
    return 0.0;
  }
};

// From dv = corr(g, k) + D ⊙ g: du = dv ⊙ pre (dv without one), dpre = dv ⊙ u; g from g_keep, else
// dy ⊙ post read again. With sum_dD, returns the sum of g ⊙ v in double precision (dD as a direct sum: lag 0
// of the FFT correlation, or a float32 sum, measured several times the error of PyTorch's pairwise sum).
template <typename T>
struct InputGradStore {
  static constexpr bool kWritesSmem = false;
  static constexpr int kFetchGroup = 4;
  struct Inputs {
    float g[2], u[2], pre[2];
  };
  GatedLoad<T> v;
  T* du;
  T* dpre;
  GatedLoad<T> g;
  const float* g_keep;
  float D;
  bool with_d;
  bool sum_dD;
  float scale;
  BEM_FFT_FN Inputs fetch(int n) const {
    Inputs in;
#pragma unroll
    for (int e = 0; e < 2; ++e) {
      const int m = 2 * n + e;
      const bool inside = m < g.L;
      in.g[e] = (with_d || sum_dD) && inside ? (g_keep ? g_keep[m] : g.value(m)) : 0.0f;
      in.u[e] = (dpre || sum_dD) && inside ? to_f(v.a[m]) : 0.0f;
      in.pre[e] = v.gate && (du || sum_dD) && inside ? to_f(v.gate[m]) : 1.0f;
    }
    return in;
  }
  BEM_FFT_FN double one(int m, float dv, const Inputs& in, int e) const {
    if (m >= g.L) return 0.0;
    double dD = 0.0;
    if (with_d) dv += D * in.g[e];
    if (sum_dD) dD = (double)in.g[e] * (double)(v.gate ? in.u[e] * in.pre[e] : in.u[e]);
    if (du) du[m] = from_f<T>(v.gate ? dv * in.pre[e] : dv);
    if (dpre) dpre[m] = from_f<T>(dv * in.u[e]);
    return dD;
  }
  BEM_FFT_FN double operator()(int n, float2 z, const Inputs& in) const {
    return one(2 * n, z.x * scale, in, 0) + one(2 * n + 1, z.y * scale, in, 1);
  }
};

struct CorrelationStore {
  BEM_FFT_FETCHES_NOTHING
  static constexpr bool kWritesSmem = false;
  float* out;
  int taps;
  float scale;
  BEM_FFT_FN double operator()(int n, float2 z, NoInputs) const {
    if (2 * n < taps) out[2 * n] = z.x * scale;
    if (2 * n + 1 < taps) out[2 * n + 1] = z.y * scale;
    return 0.0;
  }
};

// ---------------------------------------------------------------------------------------------------
// the kernels' bodies (their __global__ wrappers: fftconv_forward.cuh, fftconv_backward.cuh, fftconv_dispatch.cu)

template <typename T>
struct SpectrumParams {
  const T* k;
  float2* S;
  int H, Lk, taps;
};

template <int M, typename T>
BEM_FFT_FN void spectrum_body(const SpectrumParams<T>& p) {
  BEM_FFT_SHARED(smem);
  const BlockFft<M> fft(smem);
  fft.build_twiddles();
  for (int h = blockIdx.x; h < p.H; h += gridDim.x)
    fft.forward(GatedLoad<T>{p.k + (int64_t)h * p.Lk, nullptr, p.taps}, SpectrumOp{nullptr, p.S + (int64_t)h * (M + 1)});
}

template <typename T>
struct ForwardParams {
  const T* u;
  const T* pre;
  const T* post;
  const float2* S;
  const float* D;
  T* y;
  int64_t rows;
  int H, L;
  bool gelu;
};

template <int M, typename T>
BEM_FFT_FN void forward_body(const ForwardParams<T>& p) {
  BEM_FFT_SHARED(smem);
  const BlockFft<M> fft(smem);
  fft.build_twiddles();
  const float scale = 1.0f / (4.0f * M);
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const int64_t at = row * p.L;
    const int h = (int)(row % p.H);
    // into L2 while this row transforms: its post-gate (read by the epilogue) and the next row's inputs
    prefetch_row_l2(p.post ? p.post + at : nullptr, p.L, fft.t, Plan<M>::kThreads);
    if (row + gridDim.x < p.rows) {
      const int64_t next = (row + gridDim.x) * p.L;
      prefetch_row_l2(p.u + next, p.L, fft.t, Plan<M>::kThreads);
      prefetch_row_l2(p.pre ? p.pre + next : nullptr, p.L, fft.t, Plan<M>::kThreads);
    }
    const GatedLoad<T> v{p.u + at, p.pre ? p.pre + at : nullptr, p.L};
    fft.forward(v, ConvOp{p.S + (int64_t)h * (M + 1)});
    fft.inverse(ForwardStore<T>{v, p.y + at, p.post ? p.post + at : nullptr, p.D ? p.D[h] : 0.0f, p.D != nullptr,
                                scale, p.gelu});
  }
}

// scratch per block of the filter's pass: V (M + 1 float2), acc (M + 1 float2)
template <int M>
BEM_FFT_HD constexpr int64_t backward_scratch_floats() { return 4 * (M + 1); }

template <typename T>
struct BackwardParams {
  const T* dy;
  const T* u;
  const T* pre;
  const T* post;
  const float2* S;
  const float* D;
  T* du;
  T* dpre;
  T* dpost;
  float* dk_part;
  float* dD_part;  // (H, groups)
  float* scratch;
  float* g_rows;  // (B, H, L) float32 g between the split passes, or null
  int B, H, L, taps, groups, rows_per_group;
  bool gelu;
};

// kPass (fftconv_pass.h): kActivation writes g to g_rows (and dpostgate), kInputs computes du, dpregate and dD's
// shares, kFilter dk's. kGRows: g is read from g_rows (written by kActivation), else formed as dy ⊙ postgate.
template <int M, typename T, BackwardPass kPass, bool kGRows>
BEM_FFT_FN void backward_body(const BackwardParams<T>& p) {
  static_assert(kGRows || kPass != BackwardPass::kActivation, "the activation pass writes g_rows");
  BEM_FFT_SHARED(smem);
  const BlockFft<M> fft(smem);
  fft.build_twiddles();
  const float scale = 1.0f / (4.0f * M);
  const bool dk = kPass == BackwardPass::kFilter && p.dk_part;
  float* mine = dk ? p.scratch + (int64_t)blockIdx.x * backward_scratch_floats<M>() : nullptr;
  float2* V = reinterpret_cast<float2*>(mine);                                 // 2 FFT(v) of this row
  float2* acc = dk ? reinterpret_cast<float2*>(mine) + (M + 1) : nullptr;      // sum of G conj(V)
  const int64_t items = (int64_t)p.H * p.groups;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int h = (int)(item % p.H), group = (int)(item / p.H);
    const float2* S = p.S + (int64_t)h * (M + 1);
    const float D = p.D ? p.D[h] : 0.0f;
    const int b0 = group * p.rows_per_group;
    const int b1 = b0 + p.rows_per_group < p.B ? b0 + p.rows_per_group : p.B;
    double dD_sum = 0.0;
    for (int b = b0; b < b1; ++b) {
      const int64_t at = ((int64_t)b * p.H + h) * p.L;
      const GatedLoad<T> v{p.u + at, p.pre ? p.pre + at : nullptr, p.L};
      const GatedLoad<T> g{p.dy + at, p.post ? p.post + at : nullptr, p.L};  // g without the activation
      float* const g_row = kGRows ? p.g_rows + at : nullptr;
      // into L2 while the row's first transform runs: what it reads after it
      if (kGRows && kPass != BackwardPass::kActivation) {
        prefetch_row_l2(g_row, p.L, fft.t, Plan<M>::kThreads);
      } else {
        prefetch_row_l2(p.dy + at, p.L, fft.t, Plan<M>::kThreads);
        prefetch_row_l2(p.post ? p.post + at : nullptr, p.L, fft.t, Plan<M>::kThreads);
      }
      const auto prefetch_next_row = [&] {  // into L2 while this row's last transform runs
        if (b + 1 < b1) {
          const int64_t next = at + (int64_t)p.H * p.L;
          prefetch_row_l2(p.u + next, p.L, fft.t, Plan<M>::kThreads);
          prefetch_row_l2(p.pre ? p.pre + next : nullptr, p.L, fft.t, Plan<M>::kThreads);
        }
      };
      const auto forward_g = [&](const auto& op) {  // FFT(g), then op on its bins
        if constexpr (kGRows) {
          fft.forward(GatedLoad<float>{g_row, nullptr, p.L}, op);
        } else {
          fft.forward(g, op);
        }
      };
      if constexpr (kPass == BackwardPass::kActivation) {  // c = conv(v, k) + D v again; g and dpost from it
        fft.forward(v, ConvOp{S});
        prefetch_next_row();
        fft.inverse(ActivationGradStore<M, T>{&fft, v, p.dy + at, p.post ? p.post + at : nullptr,
                                              p.dpost ? p.dpost + at : nullptr, g_row, D, p.D != nullptr, scale,
                                              p.gelu});
      } else if constexpr (kPass == BackwardPass::kInputs) {
        forward_g(GradOp{S});
        prefetch_next_row();
        dD_sum += fft.inverse(InputGradStore<T>{v, p.du ? p.du + at : nullptr, p.dpre ? p.dpre + at : nullptr, g,
                                                g_row, D, p.D != nullptr, p.dD_part != nullptr, scale});
      } else {
        fft.forward(v, KeepOp{nullptr, V});
        prefetch_next_row();
        forward_g(FilterGradOp{nullptr, V, acc, b == b0});
      }
    }
    if (kPass == BackwardPass::kInputs && p.dD_part) {
      const double total = fft.block_sum(dD_sum);
      if (fft.t == 0) p.dD_part[(int64_t)h * p.groups + group] = (float)total;
    }
    if (dk && b1 > b0) {
      fft.pair_only(AccumulatedOp{nullptr, acc});
      fft.inverse(CorrelationStore{p.dk_part + ((int64_t)h * p.groups + group) * p.taps, p.taps, 0.5f * scale});
    }
  }
}

}  // namespace fftconv
}  // namespace bem
