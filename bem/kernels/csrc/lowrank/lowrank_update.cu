// The generated update s * ((A B) ⊙ codes) U^T in one pass over A and Y.
//
// Each block owns 32 rows. Phase 1 streams its rows of A (cp.async, 4 stages) against B on the tensor
// cores and keeps P = A B (32 x r) on chip; phase 2 multiplies the scaled, code-modulated P by U^T one
// 128-column tile at a time and writes (or accumulates into) Y. A is read once and Y written once,
// so the kernel runs at memory speed. float/double take a simple CUDA-core path (gradcheck, fp32).
#include "../common/common.cuh"
#include "launchers.h"

namespace bem {
namespace {

using namespace nvcuda;

constexpr int kBM = 32, kBK = 64, kBN = 128, kStages = 4, kThreads = 128;

template <int RP> struct UpdateLayout {
  static constexpr int x_ld = kBK + kPad;
  static constexpr int v_ld = RP + kPad;
  static constexpr int x_bytes = round_up(kBM * x_ld * 2, 128);
  static constexpr int v_bytes = round_up(kBK * v_ld * 2, 128);
  static constexpr int stage_bytes = x_bytes + v_bytes;
  static constexpr int red_ld = RP + 4;
  static constexpr int red_bytes = round_up(2 * kBM * red_ld * 4, 128);
  static constexpr int u_ld = RP + kPad;
  static constexpr int u_bytes = round_up(kBN * u_ld * 2, 128);
  static constexpr int y_ld = kBN + 4;
  static constexpr int y_bytes = round_up(kBM * y_ld * 4, 128);
  static constexpr int pc_ld = RP + kPad;
  static constexpr int pc_bytes = round_up(kBM * pc_ld * 2, 128);
  static constexpr int main_bytes = cmax(cmax(kStages * stage_bytes, red_bytes), 2 * u_bytes + y_bytes);
  static constexpr int total_bytes = main_bytes + pc_bytes;
};

struct UpdateFlags {
  bool expand, accumulate, a_vec, b_vec, u_vec, y_vec;
};

template <typename T, int RT>
__global__ void __launch_bounds__(kThreads) lowrank_update_kernel(
    const T* __restrict__ A, const T* __restrict__ B, const T* __restrict__ codes, const T* __restrict__ U,
    const T* __restrict__ bias, T* __restrict__ Y, float* __restrict__ P, const float* __restrict__ P_in, int M,
    int L, int N, int r, int n_chunks, float scale, UpdateFlags f) {
  constexpr int RP = RT * 16;
  using Lay = UpdateLayout<RP>;
  extern __shared__ __align__(128) unsigned char smem[];
  T* pc = reinterpret_cast<T*>(smem + Lay::main_bytes);
  const T zero = from_acc<T>(0.f);
  const int tid = threadIdx.x, warp = tid / 32;
  // Blocks of one row group sit next to each other (one per column chunk), so they share A in L2.
  const int m0 = (blockIdx.x / n_chunks) * kBM;
  const int chunk = blockIdx.x % n_chunks;

  float* red = reinterpret_cast<float*>(smem);
  if (P_in == nullptr) {  // Phase 1 (else P = A B came from cuBLAS: small M, where one block per 32 rows is too few)
  // B's pad columns r..RP-1 are never copied, so every stage starts as zeros.
  for (int i = tid; i < kStages * Lay::stage_bytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  auto stage_a = [&](int s) { return reinterpret_cast<T*>(smem + s * Lay::stage_bytes); };
  auto stage_b = [&](int s) { return reinterpret_cast<T*>(smem + s * Lay::stage_bytes + Lay::x_bytes); };

  auto load_stage = [&](int s, int kt) {
    const int k0 = kt * kBK;
    T* as = stage_a(s);
    T* bs = stage_b(s);
    if (f.a_vec) {
      for (int i = tid; i < kBM * kBK / 8; i += kThreads) {
        const int row = i / (kBK / 8), col = (i % (kBK / 8)) * 8;
        const int gm = m0 + row, gk = k0 + col;
        const bool ok = gm < M && gk < L;
        cp_async16(as + row * Lay::x_ld + col, ok ? A + (size_t)gm * L + gk : A, ok);
      }
    } else {
      for (int i = tid; i < kBM * kBK; i += kThreads) {
        const int row = i / kBK, col = i % kBK;
        const int gm = m0 + row, gk = k0 + col;
        as[row * Lay::x_ld + col] = (gm < M && gk < L) ? A[(size_t)gm * L + gk] : zero;
      }
    }
    if (f.b_vec) {
      const int vpr = r / 8;
      for (int i = tid; i < kBK * vpr; i += kThreads) {
        const int row = i / vpr, col = (i % vpr) * 8;
        const bool ok = k0 + row < L;
        cp_async16(bs + row * Lay::v_ld + col, ok ? B + (size_t)(k0 + row) * r + col : B, ok);
      }
    } else {
      for (int i = tid; i < kBK * RP; i += kThreads) {
        const int row = i / RP, col = i % RP;
        bs[row * Lay::v_ld + col] = (k0 + row < L && col < r) ? B[(size_t)(k0 + row) * r + col] : zero;
      }
    }
  };

  // Phase 1: warps split as 2 row groups x 2 halves of each 64-wide K step.
  const int rg = warp & 1, kh = warp >> 1;
  wmma::fragment<wmma::accumulator, 16, 16, 16, float> acc[RT];
#pragma unroll
  for (int t = 0; t < RT; ++t) wmma::fill_fragment(acc[t], 0.f);

  const int ktiles = (L + kBK - 1) / kBK;
#pragma unroll
  for (int s = 0; s < kStages - 1; ++s) {
    if (s < ktiles) load_stage(s, s);
    cp_async_commit();
  }
  for (int kt = 0; kt < ktiles; ++kt) {
    cp_async_wait<kStages - 2>();
    __syncthreads();
    const int next = kt + kStages - 1;
    if (next < ktiles) load_stage(next % kStages, next);
    cp_async_commit();
    const T* as = stage_a(kt % kStages);
    const T* bs = stage_b(kt % kStages);
#pragma unroll
    for (int kk = kh * 2; kk < kh * 2 + 2; ++kk) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a;
      wmma::load_matrix_sync(a, as + rg * 16 * Lay::x_ld + kk * 16, Lay::x_ld);
#pragma unroll
      for (int t = 0; t < RT; ++t) {
        wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::row_major> b;
        wmma::load_matrix_sync(b, bs + kk * 16 * Lay::v_ld + t * 16, Lay::v_ld);
        wmma::mma_sync(acc[t], a, b, acc[t]);
      }
    }
  }
  cp_async_wait<0>();
  __syncthreads();

  // Sum the two K halves; keep P (fp32) for the backward and s * P ⊙ c (as T) for phase 2.
#pragma unroll
  for (int t = 0; t < RT; ++t)
    wmma::store_matrix_sync(red + (kh * kBM + rg * 16) * Lay::red_ld + t * 16, acc[t], Lay::red_ld,
                            wmma::mem_row_major);
  __syncthreads();
  }
  for (int i = tid; i < kBM * RP; i += kThreads) {
    const int row = i / RP, j = i % RP, gm = m0 + row;
    float p = 0.f;
    if (P_in == nullptr) p = red[row * Lay::red_ld + j] + red[(kBM + row) * Lay::red_ld + j];
    else if (gm < M && j < r) p = P_in[(size_t)gm * r + j];
    float c = 0.f;
    if (gm < M && j < r) {
      if (P != nullptr && chunk == 0) P[(size_t)gm * r + j] = p;
      c = codes ? to_acc(codes[(size_t)gm * r + j]) : 1.f;
    }
    pc[row * Lay::pc_ld + j] = from_acc<T>(scale * p * c);
  }
  if (!f.expand) return;
  __syncthreads();  // red aliases the U tiles and the output staging below

  T* ubuf0 = reinterpret_cast<T*>(smem);
  T* ubuf1 = reinterpret_cast<T*>(smem + Lay::u_bytes);
  float* ys = reinterpret_cast<float*>(smem + 2 * Lay::u_bytes);
  // U's pad columns are never copied either.
  for (int i = tid; i < 2 * Lay::u_bytes / 16; i += kThreads)
    reinterpret_cast<uint4*>(smem)[i] = make_uint4(0, 0, 0, 0);
  __syncthreads();

  auto load_u = [&](T* ub, int n0) {
    if (f.u_vec) {
      const int vpr = r / 8;
      for (int i = tid; i < kBN * vpr; i += kThreads) {
        const int row = i / vpr, col = (i % vpr) * 8;
        const bool ok = n0 + row < N;
        cp_async16(ub + row * Lay::u_ld + col, ok ? U + (size_t)(n0 + row) * r + col : U, ok);
      }
    } else {
      for (int i = tid; i < kBN * RP; i += kThreads) {
        const int row = i / RP, col = i % RP;
        ub[row * Lay::u_ld + col] = (n0 + row < N && col < r) ? U[(size_t)(n0 + row) * r + col] : zero;
      }
    }
  };

  // Phase 2: warp w owns output columns [32w, 32w + 32) of each 128-wide tile, both 16-row groups;
  // it stages and writes only its own columns, so only the shared U tile needs a block barrier.
  const int ntiles_all = (N + kBN - 1) / kBN;
  const int per_chunk = (ntiles_all + n_chunks - 1) / n_chunks;
  const int nt_begin = chunk * per_chunk;
  const int nt_end = min(ntiles_all, nt_begin + per_chunk);
  if (nt_begin < nt_end) {
    load_u(ubuf0, nt_begin * kBN);
    cp_async_commit();
  }
  const int lane = tid % 32;
  for (int nt = nt_begin; nt < nt_end; ++nt) {
    const int it = nt - nt_begin;
    if (nt + 1 < nt_end) {
      load_u((it + 1) & 1 ? ubuf1 : ubuf0, (nt + 1) * kBN);
      cp_async_commit();
      cp_async_wait<1>();
    } else {
      cp_async_wait<0>();
    }
    __syncthreads();
    const T* ub = (it & 1) ? ubuf1 : ubuf0;
    wmma::fragment<wmma::accumulator, 16, 16, 16, float> out[2][2];
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j) wmma::fill_fragment(out[i][j], 0.f);
#pragma unroll
    for (int t = 0; t < RT; ++t) {
      wmma::fragment<wmma::matrix_a, 16, 16, 16, T, wmma::row_major> a[2];
      wmma::fragment<wmma::matrix_b, 16, 16, 16, T, wmma::col_major> b[2];
#pragma unroll
      for (int i = 0; i < 2; ++i) wmma::load_matrix_sync(a[i], pc + i * 16 * Lay::pc_ld + t * 16, Lay::pc_ld);
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::load_matrix_sync(b[j], ub + (warp * 32 + j * 16) * Lay::u_ld + t * 16, Lay::u_ld);
#pragma unroll
      for (int i = 0; i < 2; ++i)
#pragma unroll
        for (int j = 0; j < 2; ++j) wmma::mma_sync(out[i][j], a[i], b[j], out[i][j]);
    }
#pragma unroll
    for (int i = 0; i < 2; ++i)
#pragma unroll
      for (int j = 0; j < 2; ++j)
        wmma::store_matrix_sync(ys + i * 16 * Lay::y_ld + warp * 32 + j * 16, out[i][j], Lay::y_ld,
                                wmma::mem_row_major);
    __syncwarp();

    const int n0 = nt * kBN + warp * 32;
    const float* yw = ys + warp * 32;
    if (f.y_vec) {
      // 32 rows x 32 columns = 128 vectors of 8: lane l writes rows l/4 + 8q, columns 8 (l % 4).
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        const int row = lane / 4 + 8 * q, col = (lane % 4) * 8;
        const int gm = m0 + row, gn = n0 + col;
        if (gm >= M || gn >= N) continue;
        float v[8];
#pragma unroll
        for (int e = 0; e < 8; ++e) v[e] = yw[row * Lay::y_ld + col + e];
        store8<T>(Y + (size_t)gm * N + gn, v, bias ? bias + gn : nullptr, f.accumulate);
      }
    } else {
      for (int i = lane; i < kBM * 32; i += 32) {
        const int row = i / 32, col = i % 32;
        const int gm = m0 + row, gn = n0 + col;
        if (gm >= M || gn >= N) continue;
        float v = yw[row * Lay::y_ld + col];
        if (bias) v += to_acc(bias[gn]);
        T* dst = Y + (size_t)gm * N + gn;
        if (f.accumulate) v += to_acc(*dst);
        *dst = from_acc<T>(v);
      }
    }
    __syncwarp();
    __syncthreads();  // every warp is done with this U buffer before it is refilled
  }
}

// ---- float / double: one thread per output element, accumulation in float / double ----

template <typename T>
__global__ void project_generic_kernel(const T* __restrict__ A, const T* __restrict__ B,
                                       typename Acc<T>::type* __restrict__ P, int M, int L, int r) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)M * r) return;
  const int m = idx / r, j = idx % r;
  typename Acc<T>::type acc = 0;
  for (int l = 0; l < L; ++l) acc += to_acc(A[(size_t)m * L + l]) * to_acc(B[(size_t)l * r + j]);
  P[idx] = acc;
}

template <typename T>
__global__ void expand_generic_kernel(const typename Acc<T>::type* __restrict__ P, const T* __restrict__ codes,
                                      const T* __restrict__ U, const T* __restrict__ bias, T* __restrict__ Y,
                                      int M, int N, int r, typename Acc<T>::type scale, bool accumulate) {
  const size_t idx = (size_t)blockIdx.x * blockDim.x + threadIdx.x;
  if (idx >= (size_t)M * N) return;
  const int m = idx / N, n = idx % N;
  double acc = 0;  // a double running sum keeps float32 within PyTorch's blocked-sum error at r = 128
  for (int j = 0; j < r; ++j) {
    const double c = codes ? to_acc(codes[(size_t)m * r + j]) : 1;
    acc += (double)P[(size_t)m * r + j] * c * (double)to_acc(U[(size_t)n * r + j]);
  }
  acc *= (double)scale;
  if (bias) acc += to_acc(bias[n]);
  if (accumulate) acc += to_acc(Y[idx]);
  Y[idx] = static_cast<T>(acc);
}


template <typename T, int RT>
cudaError_t launch_tensor_core(const LowRankArgs& a, cudaStream_t stream) {
  using Lay = UpdateLayout<RT * 16>;
  auto kernel = lowrank_update_kernel<T, RT>;
  cudaError_t err = cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, Lay::total_bytes);
  if (err != cudaSuccess) return err;
  UpdateFlags f;
  f.expand = a.expand;
  f.accumulate = a.accumulate;
  f.a_vec = a.L % 8 == 0 && aligned16(a.A);
  f.b_vec = a.r % 8 == 0 && aligned16(a.B);
  f.u_vec = a.expand && a.r % 8 == 0 && aligned16(a.U);
  f.y_vec = a.expand && a.N % 8 == 0 && aligned16(a.Y) && (a.bias == nullptr || aligned16(a.bias));
  // Few row groups (small M): split the columns too, so every multiprocessor has blocks.
  const int m_blocks = (a.M + kBM - 1) / kBM;
  const int ntiles = a.expand ? (a.N + kBN - 1) / kBN : 1;
  int n_chunks = (2 * a.num_sms + m_blocks - 1) / m_blocks;
  n_chunks = n_chunks < 1 ? 1 : (n_chunks > ntiles ? ntiles : n_chunks);
  const dim3 grid(m_blocks * n_chunks);
  kernel<<<grid, kThreads, Lay::total_bytes, stream>>>(
      static_cast<const T*>(a.A), static_cast<const T*>(a.B), static_cast<const T*>(a.codes),
      static_cast<const T*>(a.U), static_cast<const T*>(a.bias), static_cast<T*>(a.Y), static_cast<float*>(a.P),
      static_cast<const float*>(a.P_in), a.M, a.L, a.N, a.r, n_chunks, static_cast<float>(a.scale), f);
  return cudaGetLastError();
}

template <typename T>
cudaError_t launch_tensor_core_rank(const LowRankArgs& a, cudaStream_t stream) {
  if (a.r <= 16) return launch_tensor_core<T, 1>(a, stream);
  if (a.r <= 32) return launch_tensor_core<T, 2>(a, stream);
  if (a.r <= 64) return launch_tensor_core<T, 4>(a, stream);
  if (a.r <= kMaxFusedRank) return launch_tensor_core<T, 8>(a, stream);
  return cudaErrorInvalidValue;
}

template <typename T>
cudaError_t launch_generic(const LowRankArgs& a, cudaStream_t stream) {
  using AccT = typename Acc<T>::type;
  constexpr int threads = 256;
  const AccT* P = static_cast<const AccT*>(a.P_in ? a.P_in : a.P);
  if (a.P_in == nullptr) {
    const size_t np = (size_t)a.M * a.r;
    project_generic_kernel<T><<<(np + threads - 1) / threads, threads, 0, stream>>>(
        static_cast<const T*>(a.A), static_cast<const T*>(a.B), static_cast<AccT*>(a.P), a.M, a.L, a.r);
    cudaError_t err = cudaGetLastError();
    if (err != cudaSuccess) return err;
  }
  if (!a.expand) return cudaSuccess;
  const size_t ny = (size_t)a.M * a.N;
  expand_generic_kernel<T><<<(ny + threads - 1) / threads, threads, 0, stream>>>(
      P, static_cast<const T*>(a.codes), static_cast<const T*>(a.U),
      static_cast<const T*>(a.bias), static_cast<T*>(a.Y), a.M, a.N, a.r, static_cast<AccT>(a.scale),
      a.accumulate);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_lowrank_update(DType dtype, const LowRankArgs& args, cudaStream_t stream) {
  switch (dtype) {
    case DType::kHalf: return launch_tensor_core_rank<__half>(args, stream);
    case DType::kBFloat16: return launch_tensor_core_rank<__nv_bfloat16>(args, stream);
    case DType::kFloat: return launch_generic<float>(args, stream);
    case DType::kDouble: return launch_generic<double>(args, stream);
  }
  return cudaErrorInvalidValue;
}

}  // namespace bem
