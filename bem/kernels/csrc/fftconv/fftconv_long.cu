// The element-wise passes of the convolution above L = 2^20, around cuFFT's transforms (the bindings call
// them): each reads the sequence-length rows once and the float32 padded rows (2M per row) once. The four-step
// backward (16384 < L <= 2^20) uses the activation pass and dD's sums too.
#include "fftconv_launch.cuh"

namespace bem {
namespace fftconv {
namespace {

constexpr int kThreads = 256;

// rows on blockIdx.y (striding past 65535), positions on x
struct RowGrid {
  dim3 grid;
  RowGrid(int64_t rows, int64_t columns) {
    const int64_t x = (columns + kThreads - 1) / kThreads;
    grid = dim3((unsigned)(x < 2048 ? x : 2048), (unsigned)(rows < 65535 ? rows : 65535));
  }
};

#define BEM_FOR_ROWS(rows)                                                     \
  for (int64_t row = blockIdx.y; row < (rows); row += gridDim.y)

#define BEM_FOR_COLUMNS(i, n) \
  for (int64_t i = (int64_t)blockIdx.x * kThreads + threadIdx.x; i < (n); i += (int64_t)gridDim.x * kThreads)

template <typename T>
__device__ __forceinline__ float gated(const T* a, const T* gate, int64_t at) {
  const float x = to_f(a[at]);
  return gate ? x * to_f(gate[at]) : x;
}

template <typename T>
__global__ void __launch_bounds__(kThreads) pad_rows_kernel(const T* a, const T* gate, float* out, RowsArgs r) {
  const int64_t padded = (int64_t)1 << r.log2_padded;
  BEM_FOR_ROWS(r.rows) {
    BEM_FOR_COLUMNS(i, padded) out[(row << r.log2_padded) + i] = i < r.L ? gated(a, gate, row * r.L + i) : 0.0f;
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) forward_epilogue_kernel(const float* conv, RowsArgs r) {
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  const T* post = static_cast<const T*>(r.postgate);
  T* y = static_cast<T*>(r.y);
  BEM_FOR_ROWS(r.rows) {
    const float D = r.D ? r.D[row % r.H] : 0.0f;
    BEM_FOR_COLUMNS(i, r.L) {
      const int64_t at = row * r.L + i;
      float c = conv[(row << r.log2_padded) + i];
      if (r.D) c += D * gated(u, pre, at);
      float a = r.gelu ? gelu_f(c) : c;
      if (post) a *= to_f(post[at]);
      y[at] = from_f<T>(a);
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) activation_backward_kernel(const float* conv, float* g, RowsArgs r) {
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  const T* post = static_cast<const T*>(r.postgate);
  const T* dy = static_cast<const T*>(r.dy);
  T* dpost = static_cast<T*>(r.dpostgate);
  const int64_t padded = (int64_t)1 << r.log2_padded;
  BEM_FOR_ROWS(r.rows) {
    const float D = r.D ? r.D[row % r.H] : 0.0f;
    BEM_FOR_COLUMNS(i, padded) {
      const int64_t p = (row << r.log2_padded) + i;
      if (i >= r.L) {
        g[p] = 0.0f;
        continue;
      }
      const int64_t at = row * r.L + i;
      float c = conv[p];
      if (r.D) c += D * gated(u, pre, at);
      const float dyv = to_f(dy[at]);
      if (dpost) dpost[at] = from_f<T>(dyv * (r.gelu ? gelu_f(c) : c));
      float gv = post ? dyv * to_f(post[at]) : dyv;
      if (r.gelu) gv *= gelu_grad_f(c);
      g[p] = gv;
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(kThreads) input_grads_kernel(const float* corr, const float* g, RowsArgs r) {
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  T* du = static_cast<T*>(r.du);
  T* dpre = static_cast<T*>(r.dpregate);
  BEM_FOR_ROWS(r.rows) {
    const float D = r.D ? r.D[row % r.H] : 0.0f;
    BEM_FOR_COLUMNS(i, r.L) {
      const int64_t p = (row << r.log2_padded) + i, at = row * r.L + i;
      float dv = corr[p];
      if (r.D) dv += D * g[p];
      if (du) du[at] = from_f<T>(pre ? dv * to_f(pre[at]) : dv);
      if (dpre) dpre[at] = from_f<T>(dv * to_f(u[at]));
    }
  }
}

// part[row * gridDim.x + chunk] = sum over the chunk of g v in double, v = u ⊙ pregate, g from float32 rows of
// g_stride or, with g_rows null, dy ⊙ postgate
template <typename T>
__global__ void __launch_bounds__(kThreads) dD_parts_kernel(const float* g_rows, int64_t g_stride, RowsArgs r,
                                                            double* part) {
  __shared__ double warp_sums[kThreads / 32];
  const T* u = static_cast<const T*>(r.u);
  const T* pre = static_cast<const T*>(r.pregate);
  const T* dy = static_cast<const T*>(r.dy);
  const T* post = static_cast<const T*>(r.postgate);
  const int64_t chunk = (r.L + gridDim.x - 1) / gridDim.x;
  BEM_FOR_ROWS(r.rows) {
    const int64_t begin = blockIdx.x * chunk, end = begin + chunk < r.L ? begin + chunk : r.L;
    double sum = 0.0;
    for (int64_t i = begin + threadIdx.x; i < end; i += kThreads) {
      const int64_t at = row * r.L + i;
      const float g = g_rows ? g_rows[row * g_stride + i] : gated(dy, post, at);
      sum += (double)g * (double)gated(u, pre, at);
    }
    for (int offset = 16; offset > 0; offset /= 2) sum += __shfl_down_sync(0xffffffffu, sum, offset);
    if (threadIdx.x % 32 == 0) warp_sums[threadIdx.x / 32] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
      double total = 0.0;
      for (int w = 0; w < kThreads / 32; ++w) total += warp_sums[w];
      part[row * gridDim.x + blockIdx.x] = total;
    }
    __syncthreads();
  }
}

}  // namespace

cudaError_t launch_dD_parts(Dtype dtype, const float* g_rows, int64_t g_stride, const RowsArgs& rows, double* part,
                            int chunks, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    const dim3 grid((unsigned)chunks, (unsigned)(rows.rows < 65535 ? rows.rows : 65535));
    dD_parts_kernel<T><<<grid, kThreads, 0, stream>>>(g_rows, g_stride, rows, part);
    return cudaGetLastError();
  });
}

cudaError_t launch_pad_rows(Dtype dtype, const void* a, const void* gate, float* out, const RowsArgs& rows,
                            cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    pad_rows_kernel<T><<<RowGrid(rows.rows, (int64_t)1 << rows.log2_padded).grid, kThreads, 0, stream>>>(
        static_cast<const T*>(a), static_cast<const T*>(gate), out, rows);
    return cudaGetLastError();
  });
}

cudaError_t launch_forward_epilogue(Dtype dtype, const float* conv, const RowsArgs& rows, cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    forward_epilogue_kernel<T><<<RowGrid(rows.rows, rows.L).grid, kThreads, 0, stream>>>(conv, rows);
    return cudaGetLastError();
  });
}

cudaError_t launch_activation_backward(Dtype dtype, const float* conv, float* g, const RowsArgs& rows,
                                       cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    activation_backward_kernel<T><<<RowGrid(rows.rows, (int64_t)1 << rows.log2_padded).grid, kThreads, 0, stream>>>(
        conv, g, rows);
    return cudaGetLastError();
  });
}

cudaError_t launch_input_grads(Dtype dtype, const float* corr, const float* g, const RowsArgs& rows,
                               cudaStream_t stream) {
  return with_dtype(dtype, [&](auto zero) {
    using T = decltype(zero);
    input_grads_kernel<T><<<RowGrid(rows.rows, rows.L).grid, kThreads, 0, stream>>>(corr, g, rows);
    return cudaGetLastError();
  });
}

}  // namespace fftconv
}  // namespace bem
