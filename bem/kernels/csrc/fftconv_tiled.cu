// The convolution for 16384 < M <= 2^20 as a four-step FFT. The half-length complex signal z (M points,
// z[n] = v[2n] + i v[2n+1], as in fftconv_block.cuh) is an M1 x M2 matrix, z[M2 n1 + n2] at [n1][n2], with
// M2 = 8192 and M1 = M / M2 (4 .. 128):
//
//   columns: A[k1][n2] = w_M^(n2 k1) sum_n1 z[M2 n1 + n2] w_M1^(n1 k1)        (tiled_columns_kernel)
//   rows:    Z[k1 + M1 k2] = sum_n2 A[k1][n2] w_M2^(n2 k2), at [k1][k2]      (tiled_rows_kernel)
//
// A bin k and its pair M - k (the real-signal split, fftconv_block.cuh) lie in rows k1 and M1 - k1 (rows 0
// and M1/2 pair with themselves), so one block transforms a pair of rows, pairs their bins, multiplies by
// the filter's spectrum, re-tangles and transforms both rows back (the inverse as the forward transform of
// the conjugate), writing them over A with the inverse's twiddle. The inverse columns then give z' and the
// epilogue the outputs. Each element of a row goes through global memory three times (columns, rows,
// columns) where cuFFT's transforms, with the element-wise passes around them, took about ten.
//
// The filter's spectrum for these lengths is kept in the same order: S[h][k1 M2 + k2] = X[k1 + M1 k2] for
// k < M, S[h][M] = X[M] (the natural order's (M2, M1) block, transposed).
#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {
namespace {

constexpr int kRowLength = kTiledRowLength;  // M2
constexpr int kRowThreads = kRowLength / 32;  // BlockFft's threads for one row; a block holds two rows
using RowFft = BlockFft<kRowLength>;
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
// once (a Stockham pass per factor of two took 7 trips at M1 = 128).
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

template <int M1>
__device__ __forceinline__ void build_column_table(float2* table) {
  for (int q = threadIdx.x; q < M1; q += kColumnThreads) table[q] = unit_root(q, M1);
}

// Forward columns of real rows: z[n] = (x[2n], x[2n+1]), x = a ⊙ gate (gate may be null) over a row's first
// `valid` elements, zero after; A = the twiddled column transforms, rows of M float2.
template <class Plan, typename T>
__global__ void __launch_bounds__(kColumnThreads) tiled_columns_kernel(const T* a, const T* gate, int64_t stride,
                                                                       int valid, int64_t rows, float2* work) {
  extern __shared__ float4 smem_f4[];
  constexpr int M = Plan::M1 * kRowLength;
  float2* Y = reinterpret_cast<float2*>(smem_f4);
  float2* table = Y + (Plan::R2 > 1 ? kTile : 0);
  build_column_table<Plan::M1>(table);
  __syncthreads();
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

// Inverse columns and the epilogue: z' = conj(column transforms of what the rows kernel left), the
// convolution's outputs c = z' / 4M at (2n, 2n + 1), then y = postgate ⊙ act(c + D v) (as forward_epilogue).
template <class Plan, typename T>
__global__ void __launch_bounds__(kColumnThreads) tiled_epilogue_kernel(const float2* work, RowsArgs r) {
  extern __shared__ float4 smem_f4[];
  constexpr int M = Plan::M1 * kRowLength;
  float2* Y = reinterpret_cast<float2*>(smem_f4);
  float2* table = Y + (Plan::R2 > 1 ? kTile : 0);
  build_column_table<Plan::M1>(table);
  __syncthreads();
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  const T* post = static_cast<const T*>(r.postgate);
  T* y = static_cast<T*>(r.y);
  const float scale = 1.0f / (4.0f * (float)M);
  const int first = blockIdx.x * Plan::C;
  for (int64_t row = blockIdx.y; row < r.rows; row += gridDim.y) {
    const float2* in = work + row * M;
    const float D = r.D ? r.D[row % r.H] : 0.0f;
    const int64_t at = row * r.L;
    auto output = [&](int m, float conv) {
      if (m >= r.L) return;
      float v = conv * scale;
      if (r.D) {
        const float x = to_f(u[at + m]);
        v += D * (pre ? x * to_f(pre[at + m]) : x);
      }
      float o = r.gelu ? gelu_f(v) : v;
      if (post) o *= to_f(post[at + m]);
      y[at + m] = from_f<T>(o);
    };
    column_transforms<Plan, false>(
        Y, table, [&](int n1, int c) { return in[(int64_t)n1 * kRowLength + first + c]; },
        [&](int n1, int c, float2 z) {  // z' = conj(z); only n1 < M1/2 holds outputs
          if (n1 >= Plan::M1 / 2) return;
          const int m = 2 * (kRowLength * n1 + first + c);
          output(m, z.x);
          output(m + 1, -z.y);
        });
    if (Plan::R2 > 1) __syncthreads();
  }
}

// One item: the rows k1 and M1 - k1 of one (b, h) row (items with p = 0: rows 0 and M1/2, each its own pair).
// Thread (x, y) works on row y of the item with BlockFft's code (threadIdx.x is its thread index); each row
// has its own BlockFft shared memory (data, twiddle table).
struct RowItem {
  int k1[2];
  BEM_FFT_FN RowItem(int p, int M1) {
    k1[0] = p == 0 ? 0 : p;
    k1[1] = p == 0 ? M1 / 2 : M1 - p;
  }
};

// Calls f(slot_a, slot_b, k) for this thread's pairs of bins: slot = (row y, k2) as y * kRowLength + k2, k the
// bin of slot a, slot b the bin M - k (slot b == slot a where k = M/2; k = 0 pairs with the Nyquist bin, which
// has no slot).
template <class F>
BEM_FFT_FN void for_pairs(int p, int M1, const F& f) {
  const int tx = threadIdx.x, ty = threadIdx.y;
  if (p == 0) {
    // row 0 (y 0) pairs k2 with (M2 - k2) mod M2, k2 <= M2/2; row M1/2 (y 1) k2 with M2 - 1 - k2, k2 < M2/2
    if (ty == 0) {
      for (int k2 = tx; k2 <= kRowLength / 2; k2 += kRowThreads)
        f(k2, (kRowLength - k2) & (kRowLength - 1), M1 * k2);
    } else {
      for (int k2 = tx; k2 < kRowLength / 2; k2 += kRowThreads)
        f(kRowLength + k2, kRowLength + kRowLength - 1 - k2, M1 / 2 + M1 * k2);
    }
  } else {
    for (int k2 = ty * kRowThreads + tx; k2 < kRowLength; k2 += 2 * kRowThreads)
      f(k2, kRowLength + kRowLength - 1 - k2, p + M1 * k2);
  }
}

template <bool kSpectrum>
__global__ void __launch_bounds__(2 * kRowThreads, 1) tiled_rows_kernel(float2* work, float2* S, int64_t rows,
                                                                         int H, int M) {
  extern __shared__ float4 smem_f4[];
  constexpr int kRowSmem = Plan<kRowLength>::kSmemBytes / 16;  // float4s
  static_assert(Plan<kRowLength>::kSmemBytes % 16 == 0, "each row's shared memory starts 16-byte aligned");
  const RowFft mine(smem_f4 + threadIdx.y * kRowSmem);
  mine.build_twiddles();
  const int M1 = M / kRowLength, items_per_row = M1 / 2;
  const int64_t items = rows * items_per_row;
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t row = item / items_per_row;
    const int p = (int)(item % items_per_row);
    const RowItem it(p, M1);
    const int k1 = it.k1[threadIdx.y];
    float2* data = work + row * M + (int64_t)k1 * kRowLength;
    float2* spectrum = S + (row % H) * (int64_t)(M + 1);
    // the forward transform of the row
    mine.first_pass<false>([&](int n, int) { return data[n]; });
    mine.middle_passes();
    mine.pass16(Plan<kRowLength>::kPasses16 - 1);  // ends with a barrier: both rows' bins are in place
    // a slot's place in shared memory: its row's BlockFft data (padded), no RowFft per row (an array of them
    // indexed at run time went to local memory)
    auto slot_at = [&](int slot) {
      return reinterpret_cast<float2*>(smem_f4 + (slot / kRowLength) * kRowSmem) + RowFft::pad(slot & (kRowLength - 1));
    };
    auto global_of = [&](int slot) { return (int64_t)it.k1[slot / kRowLength] * kRowLength + (slot & (kRowLength - 1)); };
    for_pairs(p, M1, [&](int sa, int sb, int k) {
      float2* const at_a = slot_at(sa);
      float2* const at_b = slot_at(sb);
      const float2 A = *at_a, B = *at_b;
      const int kp = M - k;
      float s, c;
      sincospif(-(float)k / (float)M, &s, &c);
      const float2 W = make_float2(c, s);
      const float2 Bc = conj2(B);
      const float2 xe = cadd(A, Bc);
      const float2 wxo = cmul(W, mul_neg_i(csub(A, Bc)));
      const float2 Xk = cadd(xe, wxo);
      const float2 Xkp = conj2(csub(xe, wxo));
      const int64_t ga = global_of(sa), gb = k == 0 ? M : global_of(sb);
      if (kSpectrum) {
        spectrum[ga] = cscale(Xk, 0.5f);
        if (kp != k) spectrum[gb] = cscale(Xkp, 0.5f);
        return;
      }
      const float2 Yk = cmul(Xk, spectrum[ga]);
      const float2 Ykpc = conj2(cmul(Xkp, spectrum[gb]));
      const float2 ye = cadd(Yk, Ykpc);
      const float2 yo = cmulc(csub(Yk, Ykpc), W);
      *at_a = conj2(cadd(ye, mul_i(yo)));
      if (kp != k && k != 0) *at_b = cadd(ye, mul_neg_i(yo));
    });
    if (kSpectrum) continue;  // the next item's first pass reads global memory, then waits before writing
    __syncthreads();
    // the inverse: the forward transform of the conjugate, times the inverse's twiddle, over A
    mine.first_pass<false>([&](int, int padded) { return mine.ldp(padded); });
    mine.middle_passes();
    mine.pass16(Plan<kRowLength>::kPasses16 - 1);
    for (int n2 = threadIdx.x; n2 < kRowLength; n2 += kRowThreads)
      data[n2] = cmul(mine.ld(n2), unit_root(n2 * k1, M));
  }
}

dim3 column_grid(int64_t rows, int C) {
  return dim3(kRowLength / C, (unsigned)(rows < 65535 ? rows : 65535));
}

template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, int bytes) {
  return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, bytes);
}

}  // namespace

bool tiled_length(int64_t M) { return M > kMaxBlockSpectrum && M <= kMaxTiledSpectrum; }

int tiled_rows_smem_bytes() { return 2 * Plan<kRowLength>::kSmemBytes; }

cudaError_t launch_tiled_columns(Dtype dtype, const void* a, const void* gate, int64_t stride, int valid,
                                 int64_t rows, int M, float2* work, cudaStream_t stream) {
  if (!tiled_length(M)) return cudaErrorInvalidValue;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_column_length(M / kRowLength, [&](auto plan) {
      using Plan = decltype(plan);
      cudaError_t e = allow_smem(tiled_columns_kernel<Plan, T>, Plan::kSmemBytes);
      if (e != cudaSuccess) return e;
      tiled_columns_kernel<Plan, T><<<column_grid(rows, Plan::C), kColumnThreads, Plan::kSmemBytes, stream>>>(
          static_cast<const T*>(a), static_cast<const T*>(gate), stride, valid, rows, work);
      return cudaGetLastError();
    });
  });
}

cudaError_t launch_tiled_rows(bool spectrum, float2* work, float2* S, int64_t rows, int H, int M, int num_sms,
                              cudaStream_t stream) {
  if (!tiled_length(M)) return cudaErrorInvalidValue;
  auto launch = [&](auto kernel) {
    const int smem = tiled_rows_smem_bytes();
    const int resident = resident_blocks(kernel, 2 * kRowThreads, smem);
    if (resident == 0) return cudaErrorInvalidConfiguration;
    const int64_t items = rows * (M / kRowLength / 2);
    kernel<<<grid_for(items, resident, num_sms), dim3(kRowThreads, 2), smem, stream>>>(work, S, rows, H, M);
    return cudaGetLastError();
  };
  return spectrum ? launch(tiled_rows_kernel<true>) : launch(tiled_rows_kernel<false>);
}

cudaError_t launch_tiled_epilogue(Dtype dtype, const float2* work, const RowsArgs& rows, int M,
                                  cudaStream_t stream) {
  if (!tiled_length(M)) return cudaErrorInvalidValue;
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return with_column_length(M / kRowLength, [&](auto plan) {
      using Plan = decltype(plan);
      cudaError_t e = allow_smem(tiled_epilogue_kernel<Plan, T>, Plan::kSmemBytes);
      if (e != cudaSuccess) return e;
      tiled_epilogue_kernel<Plan, T><<<column_grid(rows.rows, Plan::C), kColumnThreads, Plan::kSmemBytes, stream>>>(
          work, rows);
      return cudaGetLastError();
    });
  });
}

}  // namespace fftconv
}  // namespace bem
