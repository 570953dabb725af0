// The column passes of the four-step FFT (fftconv_tiled.cu, the one file that includes this, in its anonymous
// namespace): the column transforms of a tile of a row in registers, the forward columns kernel (real rows in,
// the twiddled transforms out) and the inverse columns kernel with its outputs (the forward's epilogue, the
// convolution alone, the input gradients, dk's correlation).
#pragma once

#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {
namespace {


constexpr int kRowLength = kTiledRowLength;  // M2
constexpr int kTile = 4096;  // points a block of the column passes transforms: kTile / M1 columns of M1
constexpr int kColumnThreads = 256;

// exp(-2 pi i (a mod M) / M), M a power of two; sincospif is accurate to an ulp (no fast-math form)
__device__ __forceinline__ float2 unit_root(int a, int M) {
  float s, c;
  sincospif(-2.0f * (float)(a & (M - 1)) / (float)M, &s, &c);
  return make_float2(c, s);
}

// The column passes' plan for M1 = R1 x R2 (R1, R2 <= 16; R2 = 1 for M1 <= 16): a block transforms C =
// kTile / M1 adjacent columns n2 of one row. With n1 = R2 na + nb and k1 = ka + R1 kb, pass 1 (an item per
// (c, nb)) takes the R1 points nb, R2 + nb, .. of its column from global memory into registers, transforms
// them, multiplies by w_M1^(nb ka) and writes shared memory; pass 2 (an item per (c, ka)) reads the R2 values
// of ka, transforms them and hands k1 = ka + R1 kb to the consumer. Each point goes through shared memory
// once (radix-2 Stockham passes would take 7 trips at M1 = 128).
template <int M1_>
struct ColumnPlan {
  static constexpr int M1 = M1_;
  static constexpr int R1 = M1 <= 16 ? M1 : (M1 == 128 ? 16 : 8);
  static constexpr int R2 = M1 / R1;
  static constexpr int C = kTile / M1;
  static constexpr int kItems1 = C * R2 / kColumnThreads;  // pass-1 items per thread
  static constexpr int kItems2 = C * R1 / kColumnThreads;  // pass-2 items per thread
  static_assert(R1 * R2 == M1 && R2 <= 16 && kItems1 >= 1 && kItems2 >= 1 && C >= 32, "a plan for M1 in 4 .. 128");
  static constexpr int kSmemBytes = (R2 > 1 ? kTile : 0) * 8 + M1 * 8;  // Y, and w_M1^j
};

template <typename F>
inline cudaError_t with_column_length(int M1, F&& f) {
  switch (M1) {
    case 4: return f(ColumnPlan<4>());
    case 8: return f(ColumnPlan<8>());
    case 16: return f(ColumnPlan<16>());
    case 32: return f(ColumnPlan<32>());
    case 64: return f(ColumnPlan<64>());
    case 128: return f(ColumnPlan<128>());
    default: return cudaErrorInvalidValue;
  }
}

// The column transforms of the block's tile of one row. load(n1, c) gives the point; kHalfIn: zero for
// n1 >= M1/2 (not loaded). consume(k1, c, X) takes each output once. Shared memory: Y then the table.
template <class Plan, bool kHalfIn, class Load, class Consume>
__device__ __forceinline__ void column_transforms(float2* Y, const float2* table, const Load& load,
                                                  const Consume& consume) {
  constexpr int M1 = Plan::M1, R1 = Plan::R1, R2 = Plan::R2, C = Plan::C;
  const int t = threadIdx.x;
#pragma unroll
  for (int q = 0; q < Plan::kItems1; ++q) {
    const int i = t + q * kColumnThreads, c = i % C, nb = i / C;
    float2 v[R1];
#pragma unroll
    for (int na = 0; na < R1; ++na)
      v[na] = (kHalfIn && na >= R1 / 2) ? make_float2(0.0f, 0.0f) : load(R2 * na + nb, c);
    dft<R1, kHalfIn>(v);
    if constexpr (R2 == 1) {
#pragma unroll
      for (int ka = 0; ka < R1; ++ka) consume(ka, c, v[ka]);
    } else {
#pragma unroll
      for (int ka = 0; ka < R1; ++ka) Y[(ka * R2 + nb) * C + c] = ka == 0 ? v[0] : cmul(v[ka], table[(nb * ka) % M1]);
    }
  }
  if constexpr (R2 > 1) {
    __syncthreads();
#pragma unroll
    for (int q = 0; q < Plan::kItems2; ++q) {
      const int i = t + q * kColumnThreads, c = i % C, ka = i / C;
      float2 v[R2];
#pragma unroll
      for (int nb = 0; nb < R2; ++nb) v[nb] = Y[(ka * R2 + nb) * C + c];
      dft<R2, false>(v);
#pragma unroll
      for (int kb = 0; kb < R2; ++kb) consume(ka + R1 * kb, c, v[kb]);
    }
  }
}

// The column passes' shared memory: Y (plans of two passes), then the table w_M1^j, built and waited for.
struct ColumnShared {
  float2* Y;
  float2* table;
};
template <class Plan>
__device__ __forceinline__ ColumnShared column_shared(float4* smem) {
  float2* Y = reinterpret_cast<float2*>(smem);
  float2* table = Y + (Plan::R2 > 1 ? kTile : 0);
  for (int q = threadIdx.x; q < Plan::M1; q += kColumnThreads) table[q] = unit_root(q, Plan::M1);
  __syncthreads();
  return ColumnShared{Y, table};
}

// Forward columns of real rows: z[n] = (x[2n], x[2n+1]), x = a ⊙ gate (gate may be null) over a row's first
// `valid` elements, zero after; A = the twiddled column transforms, rows of M float2.
template <class Plan, typename T>
__global__ void __launch_bounds__(kColumnThreads) tiled_columns_kernel(const T* a, const T* gate, int64_t stride,
                                                                       int valid, int64_t rows, float2* work) {
  extern __shared__ float4 smem_f4[];
  constexpr int M = Plan::M1 * kRowLength;
  const auto [Y, table] = column_shared<Plan>(smem_f4);
  const int first = blockIdx.x * Plan::C;  // the tile's first column
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* x = a + row * stride;
    const T* g = gate ? gate + row * stride : nullptr;
    auto value = [&](int m) {
      if (m >= valid) return 0.0f;
      const float v = to_f(x[m]);
      return g ? v * to_f(g[m]) : v;
    };
    float2* out = work + row * M;
    column_transforms<Plan, true>(
        Y, table,
        [&](int n1, int c) {
          const int m = 2 * (kRowLength * n1 + first + c);
          return make_float2(value(m), value(m + 1));
        },
        [&](int k1, int c, float2 X) {
          const int n2 = first + c;
          out[(int64_t)k1 * kRowLength + n2] = k1 == 0 ? X : cmul(X, unit_root(n2 * k1, M));
        });
    if (Plan::R2 > 1) __syncthreads();  // Y is read before the next row writes it
  }
}

// The inverse columns: z' = conj(column transforms of what the rows kernel left); out(row state, m, value)
// takes the real row's element m (z' at n holds elements 2n and 2n + 1), unscaled, for m < M.
template <class Plan, class Out>
__global__ void __launch_bounds__(kColumnThreads) tiled_inverse_kernel(const float2* work, int64_t rows,
                                                                       const Out out) {
  extern __shared__ float4 smem_f4[];
  constexpr int M = Plan::M1 * kRowLength;
  const auto [Y, table] = column_shared<Plan>(smem_f4);
  const int first = blockIdx.x * Plan::C;
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const float2* in = work + row * M;
    const typename Out::Row state = out.row(row);
    column_transforms<Plan, false>(
        Y, table, [&](int n1, int c) { return in[(int64_t)n1 * kRowLength + first + c]; },
        [&](int n1, int c, float2 z) {  // only n1 < M1/2 holds outputs (L <= M)
          if (n1 >= Plan::M1 / 2) return;
          const int m = 2 * (kRowLength * n1 + first + c);
          out(state, m, z.x);
          out(state, m + 1, -z.y);
        });
    if (Plan::R2 > 1) __syncthreads();
  }
}

// y = postgate ⊙ act(c + D v), c = the convolution (as forward_epilogue)
template <typename T>
struct ForwardOut {
  RowsArgs r;
  float scale;
  struct Row {
    int64_t at;
    float D;
  };
  BEM_FFT_FN Row row(int64_t row) const { return Row{row * r.L, r.D ? r.D[row % r.H] : 0.0f}; }
  BEM_FFT_FN void operator()(const Row& w, int m, float conv) const {
    if (m >= r.L) return;
    const T* u = static_cast<const T*>(r.u);
    const T* pre = static_cast<const T*>(r.pregate);
    const T* post = static_cast<const T*>(r.postgate);
    float v = conv * scale;
    if (r.D) {
      const float x = to_f(u[w.at + m]);
      v += w.D * (pre ? x * to_f(pre[w.at + m]) : x);
    }
    float o = r.gelu ? gelu_f(v) : v;
    if (post) o *= to_f(post[w.at + m]);
    static_cast<T*>(r.y)[w.at + m] = from_f<T>(o);
  }
};

// Float32 rows of `stride`, the first `limit` values of each scaled: the convolution alone (the backward's
// activation pass adds D v; stride 2M, limit L) and dk's correlation (a row per h; stride and limit taps).
struct FloatRowsOut {
  float* out;
  int64_t stride;
  int limit;
  float scale;
  using Row = float*;
  BEM_FFT_FN Row row(int64_t row) const { return out + row * stride; }
  BEM_FFT_FN void operator()(Row w, int m, float value) const {
    if (m < limit) w[m] = value * scale;
  }
};

// dv = corr(g, k) + D g, du = dv ⊙ pregate (dv without one), dpregate = dv ⊙ u (as input_grads); g from g_rows
// (float32, rows of g_stride) or dy ⊙ postgate
template <typename T>
struct InputGradOut {
  RowsArgs r;
  const float* g_rows;
  int64_t g_stride;
  float scale;
  struct Row {
    int64_t at, g_at;
    float D;
  };
  BEM_FFT_FN Row row(int64_t row) const { return Row{row * r.L, row * g_stride, r.D ? r.D[row % r.H] : 0.0f}; }
  BEM_FFT_FN void operator()(const Row& w, int m, float corr) const {
    if (m >= r.L) return;
    const T* u = static_cast<const T*>(r.u);
    const T* pre = static_cast<const T*>(r.pregate);
    const int64_t at = w.at + m;
    float dv = corr * scale;
    if (r.D) {
      const T* post = static_cast<const T*>(r.postgate);
      const float g = g_rows ? g_rows[w.g_at + m]
                             : (post ? to_f(static_cast<const T*>(r.dy)[at]) * to_f(post[at])
                                     : to_f(static_cast<const T*>(r.dy)[at]));
      dv += w.D * g;
    }
    if (r.du) static_cast<T*>(r.du)[at] = from_f<T>(pre ? dv * to_f(pre[at]) : dv);
    if (r.dpregate) static_cast<T*>(r.dpregate)[at] = from_f<T>(dv * to_f(u[at]));
  }
};

}  // namespace
}  // namespace fftconv
}  // namespace bem
