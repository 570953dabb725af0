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
//
// The backward (tiled_backward, fftconv_tiled_ops.cpp) takes the same passes over g's and v's rows; its rows
// launch loops over one head's batch rows, keeping V's bins, summing G conj(V) for dk and sending G conj(S)
// through the inverse for du.
#include "fftconv_tiled_columns.cuh"

namespace bem {
namespace fftconv {
namespace {

constexpr int kRowThreads = kRowLength / 32;  // BlockFft's threads for one row; a block holds two rows
using RowFft = BlockFft<kRowLength>;

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

// The real signal's bins k and M - k from the complex transform's (A at k, B at M - k), both doubled (2X),
// W = exp(-2 pi i k / 2M); and back: the inverse transform's inputs at k and M - k (conjugated: the inverse
// runs as the forward transform of the conjugate) from doubled products Y (as fftconv_block.cuh's pair()).
struct Untangled {
  float2 k, kp;
};
BEM_FFT_FN Untangled untangle(float2 A, float2 B, float2 W) {
  const float2 Bc = conj2(B);
  const float2 xe = cadd(A, Bc);
  const float2 wxo = cmul(W, mul_neg_i(csub(A, Bc)));
  return Untangled{cadd(xe, wxo), conj2(csub(xe, wxo))};
}
BEM_FFT_FN Untangled retangle(float2 Yk, float2 Ykp, float2 W) {
  const float2 Ykpc = conj2(Ykp);
  const float2 ye = cadd(Yk, Ykpc);
  const float2 yo = cmulc(csub(Yk, Ykpc), W);
  return Untangled{conj2(cadd(ye, mul_i(yo))), cadd(ye, mul_neg_i(yo))};
}

// Bins 0 and M of a real row are real: where a row of bins has no slot for M, slot 0 holds (X[0], X[M]).
BEM_FFT_FN Untangled unpack_real_pair(float2 slot0) {
  return Untangled{make_float2(slot0.x, 0.0f), make_float2(slot0.y, 0.0f)};
}

template <TiledRows kMode>
__global__ void __launch_bounds__(2 * kRowThreads, 1) tiled_rows_kernel(const TiledRowsArgs p) {
  extern __shared__ float4 smem_f4[];
  constexpr int kRowSmem = Plan<kRowLength>::kSmemBytes / 16;  // float4s
  static_assert(Plan<kRowLength>::kSmemBytes % 16 == 0, "each row's shared memory starts 16-byte aligned");
  constexpr bool kPerHead = kMode == TiledRows::kGrad || kMode == TiledRows::kCorrInverse;
  const RowFft mine(smem_f4 + threadIdx.y * kRowSmem);
  mine.build_twiddles();
  const int M = p.M, M1 = M / kRowLength, items_per_row = M1 / 2;
  const int64_t items = (kPerHead ? (int64_t)p.H : p.rows) * items_per_row;
  // a slot's place in shared memory: its row's BlockFft data (padded), no RowFft per row (an array of them
  // indexed at run time went to local memory)
  auto slot_at = [&](int slot) {
    return reinterpret_cast<float2*>(smem_f4 + (slot / kRowLength) * kRowSmem) + RowFft::pad(slot & (kRowLength - 1));
  };
  auto root_2M = [&](int k) {  // exp(-2 pi i k / 2M)
    float s, c;
    sincospif(-(float)k / (float)M, &s, &c);
    return make_float2(c, s);
  };
  struct PairSlots {
    float2 *a, *b;
    float2 W;
    Untangled X;
  };
  auto open_pair = [&](int sa, int sb, int k) {  // a pair's slots, its twiddle and its real bins k and M - k
    float2* const a = slot_at(sa);
    float2* const b = slot_at(sb);
    const float2 W = root_2M(k);
    return PairSlots{a, b, W, untangle(*a, *b, W)};
  };
  auto store_pair = [&](float2* a, float2* b, int k, const Untangled& Z) {  // the inverse's inputs at k and M - k
    *a = Z.k;
    if (M - k != k && k != 0) *b = Z.kp;  // bin M/2 pairs with itself; slot 0 holds bins 0 and M
  };
  auto forward_rows = [&](const float2* data) {  // ends with a barrier: both rows' bins are in place
    mine.first_pass<false>([&](int n, int) { return data[n]; });
    mine.middle_passes();
    mine.pass16(Plan<kRowLength>::kPasses16 - 1);
  };
  auto inverse_rows_into = [&](float2* data, int k1) {  // the inverse of what the pairs left, times its twiddle
    __syncthreads();
    mine.first_pass<false>([&](int, int padded) { return mine.ldp(padded); });
    mine.middle_passes();
    mine.pass16(Plan<kRowLength>::kPasses16 - 1);
    for (int n2 = threadIdx.x; n2 < kRowLength; n2 += kRowThreads)
      data[n2] = cmul(mine.ld(n2), unit_root(n2 * k1, M));
  };
  for (int64_t item = blockIdx.x; item < items; item += gridDim.x) {
    const int64_t unit = item / items_per_row;  // the row (or the head, kPerHead)
    const int pair = (int)(item % items_per_row);
    const RowItem it(pair, M1);
    const int k1 = it.k1[threadIdx.y];
    auto global_of = [&](int slot) { return (int64_t)it.k1[slot / kRowLength] * kRowLength + (slot & (kRowLength - 1)); };
    if constexpr (kMode == TiledRows::kSpectrum || kMode == TiledRows::kConv) {
      float2* data = p.work + unit * M + (int64_t)k1 * kRowLength;
      float2* spectrum = p.S + (unit % p.H) * (int64_t)(M + 1);
      forward_rows(data);
      for_pairs(pair, M1, [&](int sa, int sb, int k) {
        const PairSlots q = open_pair(sa, sb, k);
        const int64_t ga = global_of(sa), gb = k == 0 ? M : global_of(sb);
        if (kMode == TiledRows::kSpectrum) {
          spectrum[ga] = cscale(q.X.k, 0.5f);
          if (M - k != k) spectrum[gb] = cscale(q.X.kp, 0.5f);
          return;
        }
        store_pair(q.a, q.b, k, retangle(cmul(q.X.k, spectrum[ga]), cmul(q.X.kp, spectrum[gb]), q.W));
      });
      // kSpectrum: the next item's first pass reads global memory, then waits before writing
      if (kMode == TiledRows::kConv) inverse_rows_into(data, k1);
    } else if constexpr (kMode == TiledRows::kGrad) {
      const int h = (int)unit;
      const float2* spectrum = p.S + (int64_t)h * (M + 1);
      float2* acc = p.acc + (int64_t)h * M;
      for (int b = 0; b < p.B; ++b) {
        const int64_t row = (int64_t)b * p.H + h;
        float2* V = p.V + row * M;
        float2* G = p.work + row * M;
        if (p.acc) {  // V's bins (dk), over its own rows (slot 0 of row 0: bins 0 and M)
          forward_rows(V + (int64_t)k1 * kRowLength);
          for_pairs(pair, M1, [&](int sa, int sb, int k) {
            const Untangled X = untangle(*slot_at(sa), *slot_at(sb), root_2M(k));
            if (k == 0) {
              V[0] = make_float2(X.k.x, X.kp.x);
              return;
            }
            V[global_of(sa)] = X.k;
            if (M - k != k) V[global_of(sb)] = X.kp;
          });
          __syncthreads();  // V's bins written (visible to the block); the transform's reads of shared memory done
        }
        forward_rows(G + (int64_t)k1 * kRowLength);
        for_pairs(pair, M1, [&](int sa, int sb, int k) {
          const PairSlots q = open_pair(sa, sb, k);
          const Untangled& X = q.X;
          const int kp = M - k;
          const int64_t ga = global_of(sa), gb = global_of(sb);
          if (p.acc) {  // dk's sum of G conj(V) (bins 0 and M real, in slot 0)
            if (k == 0) {
              const float2 v0 = V[0];
              const float2 c = make_float2(X.k.x * v0.x, X.kp.x * v0.y);
              acc[0] = b == 0 ? c : cadd(acc[0], c);
            } else {
              const float2 ck = cmulc(X.k, V[ga]);
              acc[ga] = b == 0 ? ck : cadd(acc[ga], ck);
              if (kp != k) {
                const float2 ckp = cmulc(X.kp, V[gb]);
                acc[gb] = b == 0 ? ckp : cadd(acc[gb], ckp);
              }
            }
          }
          if (!p.grads) return;
          store_pair(q.a, q.b, k, retangle(cmulc(X.k, spectrum[ga]), cmulc(X.kp, spectrum[k == 0 ? M : gb]), q.W));
        });
        if (p.grads) inverse_rows_into(G + (int64_t)k1 * kRowLength, k1);
        __syncthreads();  // the next batch row's transforms write shared memory
      }
    } else {  // kCorrInverse: acc's bins, doubled twice (2G conj 2V), through the inverse
      float2* acc = p.work + unit * M;
      for_pairs(pair, M1, [&](int sa, int sb, int k) {
        const Untangled Y = k == 0 ? unpack_real_pair(acc[0]) : Untangled{acc[global_of(sa)], acc[global_of(sb)]};
        store_pair(slot_at(sa), slot_at(sb), k, retangle(Y.k, Y.kp, root_2M(k)));
      });
      inverse_rows_into(acc + (int64_t)k1 * kRowLength, k1);
      __syncthreads();  // acc's rows are read before the next item's pairs write shared memory
    }
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

cudaError_t launch_tiled_rows(TiledRows mode, const TiledRowsArgs& args, int num_sms, cudaStream_t stream) {
  if (!tiled_length(args.M)) return cudaErrorInvalidValue;
  auto launch = [&](auto kernel) {
    const int smem = tiled_rows_smem_bytes();
    const int resident = resident_blocks(kernel, 2 * kRowThreads, smem);
    if (resident == 0) return cudaErrorInvalidConfiguration;
    const bool per_head = mode == TiledRows::kGrad || mode == TiledRows::kCorrInverse;
    const int64_t items = (per_head ? (int64_t)args.H : args.rows) * (args.M / kRowLength / 2);
    kernel<<<grid_for(items, resident, num_sms), dim3(kRowThreads, 2), smem, stream>>>(args);
    return cudaGetLastError();
  };
  switch (mode) {
    case TiledRows::kSpectrum: return launch(tiled_rows_kernel<TiledRows::kSpectrum>);
    case TiledRows::kConv: return launch(tiled_rows_kernel<TiledRows::kConv>);
    case TiledRows::kGrad: return launch(tiled_rows_kernel<TiledRows::kGrad>);
    case TiledRows::kCorrInverse: return launch(tiled_rows_kernel<TiledRows::kCorrInverse>);
  }
  return cudaErrorInvalidValue;
}

namespace {
template <class Out>
cudaError_t launch_inverse(const float2* work, int64_t rows, int M, const Out& out, cudaStream_t stream) {
  if (!tiled_length(M)) return cudaErrorInvalidValue;
  return with_column_length(M / kRowLength, [&](auto plan) {
    using Plan = decltype(plan);
    cudaError_t e = allow_smem(tiled_inverse_kernel<Plan, Out>, Plan::kSmemBytes);
    if (e != cudaSuccess) return e;
    tiled_inverse_kernel<Plan, Out><<<column_grid(rows, Plan::C), kColumnThreads, Plan::kSmemBytes, stream>>>(
        work, rows, out);
    return cudaGetLastError();
  });
}
float inverse_scale(int M) { return 1.0f / (4.0f * (float)M); }
}  // namespace

cudaError_t launch_tiled_epilogue(Dtype dtype, const float2* work, const RowsArgs& rows, int M,
                                  cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch_inverse(work, rows.rows, M, ForwardOut<T>{rows, inverse_scale(M)}, stream);
  });
}

cudaError_t launch_tiled_conv(const float2* work, float* out, int64_t stride, int64_t rows, int L, int M,
                              cudaStream_t stream) {
  return launch_inverse(work, rows, M, FloatRowsOut{out, stride, L, inverse_scale(M)}, stream);
}

cudaError_t launch_tiled_input_grads(Dtype dtype, const float2* work, const RowsArgs& rows, const float* g_rows,
                                     int64_t g_stride, int M, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    return launch_inverse(work, rows.rows, M, InputGradOut<T>{rows, g_rows, g_stride, inverse_scale(M)}, stream);
  });
}

cudaError_t launch_tiled_correlation(const float2* acc, float* dk, int H, int taps, int M, cudaStream_t stream) {
  // acc holds 2G conj 2V: half of the doubled products the other outputs are scaled for
  return launch_inverse(acc, H, M, FloatRowsOut{dk, taps, taps, 0.5f * inverse_scale(M)}, stream);
}

}  // namespace fftconv
}  // namespace bem
