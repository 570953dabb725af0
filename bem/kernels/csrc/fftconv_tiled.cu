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

// A tile of the column passes: C = kTile / M1 adjacent columns n2 (c fastest in shared memory, [n1][c]).
struct ColumnTile {
  int M1, C, log2C;
  __host__ __device__ explicit ColumnTile(int M) : M1(M / kRowLength), C(kTile / (M / kRowLength)), log2C(0) {
    while ((1 << log2C) < C) ++log2C;
  }
  __host__ __device__ int tiles_per_row() const { return kRowLength / C; }
};

// The column FFT of a tile: M1 points down each column, Stockham radix 2 between two buffers; returns the
// buffer holding the result in natural order. table[q] = exp(-2 pi i q / M1), q < M1 / 2.
__device__ __forceinline__ float2* column_fft(float2* in, float2* out, const float2* table, const ColumnTile& tile) {
  const int t = threadIdx.x;
  const int half = tile.M1 / 2, C = tile.C;
  for (int Ns = 1; Ns < tile.M1; Ns *= 2) {
    const int step = tile.M1 / (2 * Ns);
    for (int b = t; b < half * C; b += kColumnThreads) {
      const int c = b & (C - 1), j = b >> tile.log2C, k = j & (Ns - 1);
      const float2 x0 = in[j * C + c];
      const float2 x1 = cmul(in[(j + half) * C + c], table[k * step]);
      const int to = ((j - k) * 2 + k) * C + c;
      out[to] = cadd(x0, x1);
      out[to + Ns * C] = csub(x0, x1);
    }
    __syncthreads();
    float2* swap = in;
    in = out;
    out = swap;
  }
  return in;
}

__device__ __forceinline__ void build_column_table(float2* table, int M1) {
  for (int q = threadIdx.x; q < M1 / 2; q += kColumnThreads) table[q] = unit_root(q, M1);
}

// Forward columns of real rows: z[n] = (x[2n], x[2n+1]), x = a ⊙ gate (gate may be null) over a row's first
// `valid` elements, zero after; A = the twiddled column transforms, rows of M float2.
template <typename T>
__global__ void __launch_bounds__(kColumnThreads) tiled_columns_kernel(const T* a, const T* gate, int64_t stride,
                                                                       int valid, int64_t rows, int M,
                                                                       float2* work) {
  extern __shared__ float4 smem_f4[];
  const ColumnTile tile(M);
  float2* buf0 = reinterpret_cast<float2*>(smem_f4);
  float2* buf1 = buf0 + kTile;
  float2* table = buf1 + kTile;
  build_column_table(table, tile.M1);
  const int t = threadIdx.x;
  const int first = blockIdx.x * tile.C;  // the tile's first column
  for (int64_t row = blockIdx.y; row < rows; row += gridDim.y) {
    const T* x = a + row * stride;
    const T* g = gate ? gate + row * stride : nullptr;
    auto value = [&](int m) {
      if (m >= valid) return 0.0f;
      const float v = to_f(x[m]);
      return g ? v * to_f(g[m]) : v;
    };
    for (int i = t; i < kTile; i += kColumnThreads) {
      const int n1 = i >> tile.log2C, c = i & (tile.C - 1);
      const int m = 2 * (kRowLength * n1 + first + c);
      buf0[i] = n1 < tile.M1 / 2 ? make_float2(value(m), value(m + 1)) : make_float2(0.0f, 0.0f);
    }
    __syncthreads();
    const float2* A = column_fft(buf0, buf1, table, tile);
    float2* out = work + row * M;
    for (int i = t; i < kTile; i += kColumnThreads) {
      const int k1 = i >> tile.log2C, n2 = first + (i & (tile.C - 1));
      out[(int64_t)k1 * kRowLength + n2] = cmul(A[i], unit_root(n2 * k1, M));
    }
    __syncthreads();  // the tile's buffers are read before the next row writes them
  }
}

// Inverse columns and the epilogue: z' = conj(column transforms of what the rows kernel left), the
// convolution's outputs c = z' / 4M at (2n, 2n + 1), then y = postgate ⊙ act(c + D v) (as forward_epilogue).
template <typename T>
__global__ void __launch_bounds__(kColumnThreads) tiled_epilogue_kernel(const float2* work, RowsArgs r, int M) {
  extern __shared__ float4 smem_f4[];
  const ColumnTile tile(M);
  float2* buf0 = reinterpret_cast<float2*>(smem_f4);
  float2* buf1 = buf0 + kTile;
  float2* table = buf1 + kTile;
  build_column_table(table, tile.M1);
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  const T* post = static_cast<const T*>(r.postgate);
  T* y = static_cast<T*>(r.y);
  const float scale = 1.0f / (4.0f * (float)M);
  const int t = threadIdx.x;
  const int first = blockIdx.x * tile.C;
  for (int64_t row = blockIdx.y; row < r.rows; row += gridDim.y) {
    const float2* in = work + row * M;
    for (int i = t; i < kTile; i += kColumnThreads)
      buf0[i] = in[(int64_t)(i >> tile.log2C) * kRowLength + first + (i & (tile.C - 1))];
    __syncthreads();
    const float2* Z = column_fft(buf0, buf1, table, tile);
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
    for (int i = t; i < kTile / 2; i += kColumnThreads) {  // n1 < M1 / 2: the first half of the rows of the tile
      const float2 z = Z[i];  // z' = conj(z)
      const int n1 = i >> tile.log2C, n2 = first + (i & (tile.C - 1));
      const int m = 2 * (kRowLength * n1 + n2);
      output(m, z.x);
      output(m + 1, -z.y);
    }
    __syncthreads();
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

dim3 column_grid(int64_t rows, int M) {
  return dim3(ColumnTile(M).tiles_per_row(), (unsigned)(rows < 65535 ? rows : 65535));
}

int column_smem_bytes(int M) { return (2 * kTile + M / kRowLength / 2) * 8; }

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
    const int smem = column_smem_bytes(M);
    cudaError_t e = allow_smem(tiled_columns_kernel<T>, smem);
    if (e != cudaSuccess) return e;
    tiled_columns_kernel<T><<<column_grid(rows, M), kColumnThreads, smem, stream>>>(
        static_cast<const T*>(a), static_cast<const T*>(gate), stride, valid, rows, M, work);
    return cudaGetLastError();
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
    const int smem = column_smem_bytes(M);
    cudaError_t e = allow_smem(tiled_epilogue_kernel<T>, smem);
    if (e != cudaSuccess) return e;
    tiled_epilogue_kernel<T><<<column_grid(rows.rows, M), kColumnThreads, smem, stream>>>(work, rows, M);
    return cudaGetLastError();
  });
}

}  // namespace fftconv
}  // namespace bem
