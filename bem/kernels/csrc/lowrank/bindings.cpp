// Torch bindings of the low-rank update's kernels: the forward's choice between the decode kernels and the
// GEMM + update paths, and allocation (the backward's own ops are in backward_ops.cpp, the GEMM with the update
// inside in gemm_update_ops.cpp, the eager autograd function in linear_autograd.cpp). ../module.cpp makes the
// module bem._C of every family's bindings.
#include <torch/extension.h>

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <cstdint>
#include <vector>

#include "backward_ops.h"
#include "../common/device_info.h"
#include "gemm_update_ops.h"
#include "launchers.h"
#include "projection.h"
#include "host_checks.h"
#include "update_ops.h"

namespace bem {
void bind_linear_autograd(pybind11::module_& m);

namespace {

// How bem_linear_forward composes x W^T with the update (mode argument; 0 picks by shape).
enum LinearMode : int64_t {
  kAuto = 0,
  kDecode = 1,           // one kernel that reads W once: the streaming kernel where it fits, else kDecodeTiles
  kGemmThenUpdate = 2,   // cuBLAS x W^T + b, then the update kernel accumulates into Y
  kUpdateThenGemm = 3,   // update kernel writes update + b, then cuBLAS adds x W^T (beta = 1)
  kGemmThenAddmm = 4,    // update kernel computes only X V; cuBLAS adds (s X V ⊙ c) U^T (beta = 1)
  kDecodeTiles = 5,      // the tiled split-K decode kernel (M <= 64, any layout, sm_80+)
  kGemmUpdate = 6,       // one tensor-core GEMM with the update inside (gemm_update.cu)
  kGemmUpdateProjected = 7,  // cuBLAS P = x V, s P ⊙ c (scale_codes.cu), then that GEMM adds (s P ⊙ c) U^T
  kDecodeRows = 8,       // the row-split decode kernel (decode_rows.cu: M <= 16, sm_90, no clusters)
  kDecodeTma = 9,        // the TMA decode kernel (decode_tma.cu: M <= 16, sm_90a, W by tensor-map copies)
  kDecodeColumnsMma = 10,  // the tensor-core kernel for a transposed weight (decode_columns_mma.cu: M <= 16)
  kDecodeColumns = 11,     // the CUDA-core kernel for a transposed weight (decode_columns.cu: M <= 4)
};
// Chosen by measurement at prefill sizes (docs/kernels.md).
constexpr LinearMode kPrefillMode = kUpdateThenGemm;
// The decode kernels are the default up to this many tokens. From 17 to 64 tokens (where the streaming
// kernel does not run) the tiles kernel measured slower than kPrefillMode on an H200: 4096², r = 8, x
// F.linear: 2.52x against 2.19x at 32 tokens, 3.60x against 1.87x at 64; 4096 x 14336: 3.46x against
// 1.37x at 64 tokens (docs/kernels.md). Modes 1 and 5 can still be asked for up to kDecodeMaxTokens.
constexpr int64_t kDecodeAutoMaxTokens = 16;

// Which kernel computes the generated update (update_forward's `kernel` argument; 0 picks by shape).
enum UpdateKernel : int64_t {
  kUpdateAuto = 0,
  kUpdateStream = 1,  // lowrank_stream.cu: 16-64 rows per block (clusters of blocks at few rows)
  kUpdateTiles = 2,   // lowrank_update.cu: 32 rows per block through shared memory (any K, any rank)
  kUpdateGemms = 3,   // fp16/bf16: cuBLAS P = A B (fp32 out), scale_codes.cu, cuBLAS Y = (s P ⊙ codes) U^T
  kUpdateTma = 4,     // lowrank_tma.cu (sm_90a): TMA in and out, reading and writing at once
};
// Where the streaming kernel is the default: measured on an H200 (docs/kernels.md) it beat the tiles
// kernel at ranks 8 to 32 once M >= 1024 (M = 16384, 4096 x 4096: 49-66% of copy against 39-47%). Above
// rank 32 it needs blocks of 32 tokens or more to share its B and U loads: at M = 16384 (32 tokens)
// it was faster (fused linear 1.27x against 1.39x F.linear), at M = 4096 (16 tokens) slower (1.36x
// against 1.24x).
constexpr int64_t kStreamMinRows = 1024;
constexpr int64_t kStreamSmallBlockMaxRank = 32;
// Above rank 16 (from M = 1024 on) two cuBLAS GEMMs around a small scaling kernel measured faster than
// either update kernel: on an H200 at M = 16384, 4096 x 4096, x V read x at 85-87% of the read rate and
// P U^T wrote Y at 87-93% of the write rate, and the update took 90 us at r = 32 and 64, against 119
// and 262 us for the streaming kernel (docs/kernels.md). At r = 8 the streaming kernel stays ahead.
constexpr int64_t kGemmsMinRank = 17;
// Where the TMA update kernel is the default (sm_90a builds on Hopper), measured on an H200 against the
// other three (docs/kernels.md): up to rank 16 once its 64-row tiles are at least as many as the
// multiprocessors (M = 16384: 4096² r = 8 78% of copy against 73% for the streaming kernel, r = 16 75%
// against 71%; 4096 x 14336 r = 8 84% against 79%; 768² r = 8 65% against 56%), and at rank 8 from 2048
// rows where N >= 2 K, where writing Y dominates (4096 x 14336, M = 2048: 49% of copy against 36% for
// the streaming kernel). At 1024 rows the streaming kernel on clusters of 2 is ahead there (4096 x
// 14336: 36% against 35%; 2048 x 8192: 34% against 31%). Above rank 16 the two cuBLAS GEMMs stayed
// ahead (r = 32: 69% of copy against 63%); with few tiles and a long K each tile's single reading
// warpgroup is the bound (14336 x 4096, M = 2048: 47 us against 31 us).
constexpr int64_t kTmaMaxRank = 16;
constexpr int64_t kTmaWideMaxRank = 8;
constexpr int64_t kTmaWideMinRows = 2048;

bool tma_suits(const LowRankArgs& args) {
  const bool fills_gpu = args.M >= (int64_t)kLowRankTmaTileRows * args.num_sms;
  const bool wide = args.r <= kTmaWideMaxRank && args.N >= 2 * (int64_t)args.L && args.M >= kTmaWideMinRows;
  return args.r <= kTmaMaxRank && (fills_gpu || wide);
}

// Whether the TMA update kernel runs: asked for, or by shape (measured, docs/kernels.md). A call that
// asks for it where it cannot run is refused.
bool tma_takes(const LowRankArgs& args, bool tensor_core, int64_t kernel, int device) {
  if (args.M == 0) return false;
  if (kernel == kUpdateTma) {
    BEM_CHECK(tensor_core && sm90a_runs(device), "the TMA update kernel needs float16/bfloat16 operands, a ",
              "compute capability 9.0 GPU and the extension built for sm_90a (TORCH_CUDA_ARCH_LIST=9.0a)");
    BEM_CHECK(lowrank_tma_fits(args), "the TMA update kernel writes Y (no accumulation) and takes K, N and ",
              "the rank multiples of 8, rank up to ", kLowRankTmaMaxRank, ", and 16-byte aligned x and U; got K = ",
              args.L, ", N = ", args.N, ", rank ", args.r);
    return true;
  }
  return kernel == kUpdateAuto && tensor_core && tma_suits(args) && lowrank_tma_fits(args) && sm90a_runs(device);
}

// Too few 32-row groups to fill the GPU: the projection A B then goes to cuBLAS (fp32 output) and the
// tiles kernel only expands it.
bool small_m(const Tensor& A) {
  return tensor_core_dtype(A) && (A.size(0) + 31) / 32 < num_sms(A.get_device());
}

// Whether the streaming kernel runs: asked for, or the shape is where it measured faster (below
// kStreamMinRows only where it runs on clusters: sm_90, r <= kStreamClusterMaxRank, docs/kernels.md);
// and it takes the call (lowrank_stream_fits: the shapes and alignment its 16-byte loads need).
bool stream_takes(const LowRankArgs& args, bool tensor_core, int64_t kernel) {
  if (kernel == kUpdateTiles || !tensor_core || args.M == 0 || !lowrank_stream_fits(args)) return false;
  if (kernel == kUpdateStream) return true;
  if (!args.expand) return false;
  if (args.M < kStreamMinRows) return lowrank_stream_cluster(args) > 1;
  return args.r <= kStreamSmallBlockMaxRank || lowrank_stream_tokens(args) >= 32;
}

// Whether the update runs as two cuBLAS GEMMs: asked for, or by shape (fp16/bf16 only).
bool gemms_take(const LowRankArgs& args, bool tensor_core, int64_t kernel) {
  if (!tensor_core || !args.expand) return false;
  return kernel == kUpdateGemms ||
         (kernel == kUpdateAuto && args.M >= kStreamMinRows && args.r >= kGemmsMinRank);
}

// Y (=|+=) s (P ⊙ codes) U^T (+ bias) with P = A B from cuBLAS; returns P.
Tensor run_update_gemms(const Tensor& A, const Tensor& B, const OptTensor& codes, const Tensor& U, const Tensor* bias,
                        Tensor& Y, double scale, bool accumulate) {
  auto [P, Pc] = scaled_projection(A, B, codes, scale);
  const Tensor Ut = U.t();
  if (accumulate) {
    Y.addmm_(Pc, Ut);
  } else if (bias != nullptr) {
    at::addmm_out(Y, *bias, Pc, Ut);
  } else {
    at::mm_out(Y, Pc, Ut);
  }
  return P;
}

// Y (=|+=) s ((A B) ⊙ codes) U^T (+ bias); returns P = A B.
// Bt_given: B^T (r x L, contiguous) when the caller keeps one, so that no copy is made here.
Tensor run_update(const Tensor& A, const Tensor& B, const OptTensor& codes, const Tensor* U, const Tensor* bias,
                  Tensor* Y, double scale, bool accumulate, int64_t kernel = kUpdateAuto, int64_t stream_tokens = 0,
                  const Tensor* Bt_given = nullptr, int64_t stream_cluster = 0) {
  // The projection alone (the backward's dY U): on an H200 cuBLAS read A at 85-100% of the read rate at
  // M = 16384, where the tiles kernel reached 20-51%, and was 1.2-3.6x faster at M = 4096 and K = 768.
  if (Y == nullptr && tensor_core_dtype(A)) return project_gemm(A, B);
  const int64_t M = A.size(0), r = B.size(1);
  LowRankArgs args{};
  args.A = A.data_ptr();
  args.B = B.data_ptr();
  args.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  args.U = U ? U->data_ptr() : nullptr;
  args.bias = bias ? bias->data_ptr() : nullptr;
  args.Y = Y ? Y->data_ptr() : nullptr;
  args.M = (int)M;
  args.L = (int)A.size(1);
  args.N = U ? (int)U->size(0) : 0;
  args.r = (int)r;
  args.num_sms = num_sms(A.get_device());
  args.stream_tokens = (int)stream_tokens;
  args.stream_cluster = (int)stream_cluster;
  args.cc_major = cc_major(A.get_device());
  args.scale = scale;
  args.expand = Y != nullptr;
  args.accumulate = accumulate;
  if (Y != nullptr && tma_takes(args, tensor_core_dtype(A), kernel, A.get_device())) {
    const Tensor Bt = Bt_given ? *Bt_given : B.t().contiguous();  // r x L: rows of B^T are contiguous
    Tensor P = at::empty({M, r}, A.options().dtype(at::kFloat));
    args.Bt = Bt.data_ptr();
    args.P = P.data_ptr();
    C10_CUDA_CHECK(launch_lowrank_tma(dtype_of(A), args, stream_now()));
    return P;
  }
  if (gemms_take(args, tensor_core_dtype(A), kernel))
    return run_update_gemms(A, B, codes, *U, bias, *Y, scale, accumulate);
  const bool stream = stream_takes(args, tensor_core_dtype(A), kernel);
  // float32: cuBLAS's blocked sums are more accurate than the simple kernel's running sum.
  const bool given = !stream && (small_m(A) || A.scalar_type() == at::kFloat);
  Tensor P = given ? project_gemm(A, B) : at::empty({M, r}, A.options().dtype(p_dtype(A)));
  if (M == 0 || (given && Y == nullptr)) return P;
  args.P = given ? nullptr : P.data_ptr();
  args.P_in = given ? P.data_ptr() : nullptr;
  if (stream) {
    C10_CUDA_CHECK(launch_lowrank_stream(dtype_of(A), args, stream_now()));
  } else {
    C10_CUDA_CHECK(launch_lowrank_update(dtype_of(A), args, stream_now()));
  }
  return P;
}

}  // namespace

std::tuple<Tensor, Tensor> update_forward(const Tensor& x, const Tensor& V, const OptTensor& codes, const Tensor& U,
                                          double scale, int64_t kernel, int64_t stream_tokens,
                                          int64_t stream_cluster) {
  BEM_CHECK(kernel >= kUpdateAuto && kernel <= kUpdateTma, "unknown update kernel ", kernel);
  check_update_operands(x, V, codes, U);
  BEM_CHECK(stream_tokens == 0 || stream_tokens == 16 || stream_tokens == 32 || stream_tokens == 64,
            "stream_tokens must be 0 (chosen by shape), 16, 32 or 64, got ", stream_tokens);
  BEM_CHECK(stream_tokens != 64 || V.size(1) <= kStreamTallBlockMaxRank, "stream_tokens = 64 takes ranks up to ",
            kStreamTallBlockMaxRank, ", got rank ", V.size(1));
  BEM_CHECK(stream_cluster == 0 || stream_cluster == 1 || stream_cluster == 2 || stream_cluster == 4 ||
                stream_cluster == kStreamMaxCluster,
            "stream_cluster must be 0 (chosen by shape), 1, 2, 4 or 8, got ", stream_cluster);
  const c10::cuda::CUDAGuard guard(x.device());
  BEM_CHECK(stream_cluster <= 1 || cc_major(x.get_device()) >= 9,
            "stream_cluster above 1 needs thread-block clusters (a compute capability 9.0 GPU)");
  Tensor Y = at::empty({x.size(0), U.size(0)}, x.options());
  Tensor P = run_update(x, V, codes, &U, nullptr, &Y, scale, /*accumulate=*/false, kernel, stream_tokens, nullptr,
                        stream_cluster);
  return {Y, P};
}

// P = A B (fp32; fp64 for double), A: (M, L), B: (L, r). The backward's dY U.
Tensor project(const Tensor& A, const Tensor& B) {
  check_update_operands(A, B, c10::nullopt, B);
  const c10::cuda::CUDAGuard guard(A.device());
  return run_update(A, B, c10::nullopt, nullptr, nullptr, nullptr, 1.0, false);
}

namespace {

Tensor base_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias) {
  // weight.t() is (K, N); cuBLAS reads either layout without a copy.
  return bias.has_value() ? at::addmm(*bias, x, weight.t()) : at::mm(x, weight.t());
}

// V_t: V^T (r x K, contiguous) when the caller keeps one (a module at inference): the TMA update kernel
// and the GEMM with the update inside read V^T, and without it each call makes a copy, one more launch.
std::tuple<Tensor, Tensor> linear_rows(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& V,
                                       const OptTensor& codes, const Tensor& U, double scale, int64_t mode,
                                       int64_t split_k, bool need_p, const OptTensor& V_t, int64_t gemm_tile_n) {
  check_update_operands(x, V, codes, U);
  check_weight(x, weight, bias, U);
  if (V_t.has_value()) {
    check_like(*V_t, "V_t", x);
    check_contiguous(*V_t, "V_t");
    BEM_CHECK(V_t->dim() == 2 && V_t->size(0) == V.size(1) && V_t->size(1) == V.size(0),
              "V_t must be V transposed, (r, K) = (", V.size(1), ", ", V.size(0), "), got ", V_t->sizes());
  }
  const Tensor* Vt_given = V_t.has_value() ? &*V_t : nullptr;
  const c10::cuda::CUDAGuard guard(x.device());
  const int64_t M = x.size(0), N = U.size(0), K = x.size(1), r = V.size(1);
  const bool fits_decode = tensor_core_dtype(x) && M >= 1 && M <= kDecodeMaxTokens &&
                           (N + kDecodeTileN - 1) / kDecodeTileN <= kMaxDecodeTiles;
  const Tensor* bias_ptr = bias.has_value() ? &*bias : nullptr;
  // The decode kernels' operands, read by the automatic choice below and by the decode launches.
  DecodeArgs args{};
  args.X = x.data_ptr();
  args.W = weight.data_ptr();
  args.bias = bias_ptr ? bias_ptr->data_ptr() : nullptr;
  args.V = V.data_ptr();
  args.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  args.U = U.data_ptr();
  args.M = (int)M;
  args.N = (int)N;
  args.K = (int)K;
  args.r = (int)r;
  args.scale = (float)scale;
  args.w_transposed = !weight.is_contiguous();
  const int cc = cc_major(x.get_device());
  if (mode == kAuto && fits_decode && M <= kDecodeAutoMaxTokens) {
    // A transposed weight (GPT-2's Conv1D) above the columns kernel's tokens takes the tiles kernel, at 2.4-3.0x
    // F.linear at 8 tokens (H100). Captured into a CUDA graph, where a second launch costs no host time, cuBLAS
    // after the update kernel instead (docs/kernels.md); eagerly the one launch's host time weighs more.
    // Where the tensor-core transposed-weight kernel takes the call, it does, captured or not.
    mode = M > kDecodeColumnsMaxTokens && args.w_transposed && capturing_now() && !decode_columns_mma_fits(args, cc)
               ? kUpdateThenGemm
               : kDecode;
  } else if (mode == kAuto) {
    const GemmUpdateChoice choice = gemm_update_choice(x, weight, bias, V, U);
    mode = choice == GemmUpdateChoice::kInside      ? kGemmUpdate
           : choice == GemmUpdateChoice::kProjected ? kGemmUpdateProjected
                                                    : kPrefillMode;
  }
  BEM_CHECK(mode >= kDecode && mode <= kDecodeColumns, "unknown linear mode ", mode);
  BEM_CHECK(gemm_tile_n == 0 || gemm_tile_n == 128 || gemm_tile_n == 256,
            "gemm_tile_n must be 0 (chosen by shape), 128 or 256, got ", gemm_tile_n);
  if (!tensor_core_dtype(x) || M == 0) mode = kGemmThenUpdate;  // float/double: cuBLAS + simple kernels

  if (mode == kDecode || mode == kDecodeTiles || mode == kDecodeRows || mode == kDecodeTma ||
      mode == kDecodeColumnsMma || mode == kDecodeColumns) {
    BEM_CHECK(fits_decode, "the decode kernel takes 1..", kDecodeMaxTokens,
                " float16/bfloat16 tokens, got M = ", M, " of ", x.scalar_type());
    // Only what this call needs: at decode sizes each allocation's host cost is comparable to the kernel.
    Tensor Y = at::empty({M, N}, x.options());
    Tensor P = need_p ? at::empty({M, r}, x.options().dtype(at::kFloat)) : Tensor();
    args.Y = Y.data_ptr();
    args.P = need_p ? P.data_ptr<float>() : nullptr;
    const bool rows_fit = (mode == kDecodeRows || mode == kDecode) && decode_rows_fits(args, cc);
    if (mode == kDecodeRows) {
      BEM_CHECK(rows_fit, "the row-split decode kernel takes a row-major weight, 1..",
                kDecodeStreamMaxTokens, " tokens, ranks 1..", kDecodeStreamMaxRank, ", K a multiple of 8 up to ",
                kDecodeRowsMaxK, " and 16-byte aligned x and weight on a compute capability 9.0 GPU");
      BEM_CHECK(split_k == 0, "the row-split decode kernel does not split K (split_k = 0), got split_k = ", split_k);
    }
    const bool columns_mma_fit = (mode == kDecode || mode == kDecodeColumnsMma) && decode_columns_mma_fits(args, cc);
    if (mode == kDecodeColumnsMma) {
      BEM_CHECK(columns_mma_fit, "the tensor-core transposed-weight decode kernel takes a weight stored (K, N) "
                "row-major, 1..", kDecodeColumnsMmaMaxTokens, " tokens, rank 8 or 16, K and N multiples of 8 and ",
                "16-byte aligned x, weight and V on a compute capability 9.0 GPU");
    }
    const bool columns_fit = (mode == kDecode || mode == kDecodeColumns) && decode_columns_fits(args, cc);
    if (mode == kDecodeColumns) {
      BEM_CHECK(columns_fit, "the CUDA-core transposed-weight decode kernel takes a weight stored (K, N) row-major, "
                "1..", kDecodeColumnsMaxTokens, " tokens, ranks 1..", kDecodeColumnsMaxRank, ", N a multiple of 8 ",
                "and a 16-byte aligned weight on a compute capability 9.0 GPU");
    }
    if (mode == kDecodeTma) {
      BEM_CHECK(sm90a_runs(x.get_device()) && decode_tma_fits(args, cc), "the TMA decode kernel takes a row-major weight, 1..",
                kDecodeStreamMaxTokens, " tokens, ranks 1..", kDecodeStreamMaxRank, ", K a multiple of 8 and ",
                "16-byte aligned x and weight on a compute capability 9.0 GPU with this build's sm_90a code");
    }
    // Small matrices: the row-split kernel (no clusters), where its rule takes the shape.
    if (rows_fit && (mode == kDecodeRows || (split_k == 0 && decode_rows_takes((int)N, (int)K)))) {
      C10_CUDA_CHECK(launch_decode_rows(dtype_of(x), args, stream_now()));
      return {Y, P};
    }
    // Under CUDA-graph capture, where its second launch (the projection) costs no host time, the TMA kernel where K
    // is large (decode_tma_takes); eagerly the streaming kernel's in-block form is one launch.
    const bool tma = mode == kDecodeTma || (mode == kDecode && split_k == 0 && decode_tma_takes((int)K) &&
                                            decode_tma_fits(args, cc) && capturing_now() && sm90a_runs(x.get_device()));
    if (tma) {
      args.split_k = split_k > 0 ? (int)split_k : decode_tma_split((int)N, (int)K, x.get_device());
      BEM_CHECK(args.split_k <= kDecodeStreamMaxCluster && (args.split_k & (args.split_k - 1)) == 0,
                "the TMA decode kernel splits K over 1, 2, 4 or 8 blocks, got split_k = ", split_k);
      args.k_per_split = decode_tma_k_per_split((int)K, args.split_k);
      Tensor Pc = at::empty({M, (r + 15) / 16 * 16}, x.options());
      args.Pc = Pc.data_ptr();
      C10_CUDA_CHECK(launch_decode_tma(dtype_of(x), args, stream_now()));
      return {Y, P};
    }
    // The streaming kernel measured faster than the tiles kernel at every rank it takes (up to 64: at
    // M = 1, 4096², 1.53x against 1.98x F.linear).
    if (mode == kDecode && decode_stream_fits(args, cc)) {
      args.split_k = split_k > 0 ? (int)split_k : decode_stream_split((int)N, (int)K, x.get_device());
      BEM_CHECK(args.split_k <= kDecodeStreamMaxCluster && (args.split_k & (args.split_k - 1)) == 0,
                  "the streaming decode kernel splits K over 1, 2, 4 or 8 blocks, got split_k = ", split_k);
      args.k_per_split = ((int)K + args.split_k * 32 - 1) / (args.split_k * 32) * 32;
      Tensor Pc = decode_stream_projects_first(args) ? at::empty({M, (r + 15) / 16 * 16}, x.options()) : Tensor();
      args.Pc = Pc.defined() ? Pc.data_ptr() : nullptr;
      C10_CUDA_CHECK(launch_decode_stream(dtype_of(x), args, stream_now()));
      return {Y, P};
    }
    // A transposed weight (GPT-2's Conv1D): the CUDA-core kernel where it fits and measured ahead of the
    // tensor-core kernel (decode_columns_takes), or where that one does not fit (ranks other than 8 and 16, unaligned
    // operands); up to 4 tokens it beat the tiles kernel (H100, x F.linear at GPT-2's shapes, M = 1: 1.17-1.50
    // against 1.32-2.37; M = 4: 1.61-1.83 against 1.41-2.58).
    if (columns_fit && (mode == kDecodeColumns || !columns_mma_fit || decode_columns_takes(args))) {
      args.split_k = split_k > 0 ? (int)split_k : decode_columns_split((int)M, (int)N, (int)K, (int)r, x.get_device());
      BEM_CHECK(args.split_k <= kDecodeStreamMaxCluster && (args.split_k & (args.split_k - 1)) == 0,
                "the transposed-weight decode kernel splits K over 1, 2, 4 or 8 blocks, got split_k = ", split_k);
      args.k_per_split = ((int)K + args.split_k - 1) / args.split_k;
      C10_CUDA_CHECK(launch_decode_columns(dtype_of(x), args, stream_now()));
      return {Y, P};
    }
    // A transposed weight at 3 to 16 tokens, or from one token where K >= 2 N (or asked for): the tensor-core
    // kernel, one launch.
    if (columns_mma_fit) {
      args.split_k = split_k > 0 ? (int)split_k : decode_columns_mma_split((int)N, (int)K, (int)r, x.get_device());
      BEM_CHECK(args.split_k <= kDecodeStreamMaxCluster && (args.split_k & (args.split_k - 1)) == 0,
                "the tensor-core transposed-weight decode kernel splits K over 1, 2, 4 or 8 blocks, got split_k = ",
                split_k);
      args.k_per_split = decode_columns_mma_k_per_split((int)K, args.split_k);
      C10_CUDA_CHECK(launch_decode_columns_mma(dtype_of(x), args, stream_now()));
      return {Y, P};
    }
    const int split = decode_split_k((int)M, (int)N, (int)K, (int)r, args.w_transposed, num_sms(x.get_device()),
                                     (int)split_k);
    Tensor ws = split > 1 ? at::empty({split * M * (N + (need_p ? r : 0))}, x.options().dtype(at::kFloat)) : Tensor();
    args.ws = split > 1 ? ws.data_ptr<float>() : nullptr;
    args.ws_p = split > 1 && need_p ? ws.data_ptr<float>() + split * M * N : nullptr;
    args.split_k = split;
    args.k_per_split = decode_k_per_split((int)K, split);
    C10_CUDA_CHECK(launch_decode_linear(dtype_of(x), args, stream_now()));
    return {Y, P};
  }
  if (mode == kGemmUpdate || mode == kGemmUpdateProjected) {
    return gemm_update_linear(x, weight, bias, V, codes, U, scale, mode == kGemmUpdateProjected, need_p, Vt_given,
                              gemm_tile_n);
  }
  if (mode == kGemmThenUpdate) {
    Tensor Y = base_linear(x, weight, bias);
    Tensor P = run_update(x, V, codes, &U, nullptr, &Y, scale, /*accumulate=*/true, kUpdateAuto, 0, Vt_given);
    return {Y, P};
  }
  if (mode == kUpdateThenGemm) {
    Tensor Y = at::empty({M, N}, x.options());
    Tensor P = run_update(x, V, codes, &U, bias_ptr, &Y, scale, /*accumulate=*/false, kUpdateAuto, 0, Vt_given);
    Y.addmm_(x, weight.t());
    return {Y, P};
  }
  // kGemmThenAddmm
  Tensor P = run_update(x, V, codes, nullptr, nullptr, nullptr, 1.0, false);
  Tensor Pc = (codes.has_value() ? P * codes->to(at::kFloat) : P) * scale;  // P itself is returned
  Tensor Y = base_linear(x, weight, bias);
  Y.addmm_(Pc.to(x.scalar_type()), U.t());
  return {Y, P};
}

}  // namespace

// x (..., K) and codes (..., r) with the same leading dimensions are taken as rows; Y comes back as
// (..., N), P as (rows, r). Inference passes a model's (batch, sequence, K) activations as they are:
// flattening here instead of in Python saves a few microseconds of host time per call at decode sizes.
std::tuple<Tensor, Tensor> linear_forward(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                          const Tensor& V, const OptTensor& codes, const Tensor& U, double scale,
                                          int64_t mode, int64_t split_k, bool need_p, const OptTensor& V_t,
                                          int64_t gemm_tile_n) {
  if (x.dim() == 2) return linear_rows(x, weight, bias, V, codes, U, scale, mode, split_k, need_p, V_t, gemm_tile_n);
  BEM_CHECK(x.dim() > 2, "x must be (..., K) with at least one leading dimension, got shape ", x.sizes());
  check_contiguous(x, "x");
  const int64_t lead = x.dim() - 1;
  int64_t rows = 1;
  for (int64_t d = 0; d < lead; ++d) rows *= x.size(d);
  OptTensor codes_rows = codes;
  if (codes.has_value()) {
    BEM_CHECK(codes->dim() == x.dim() && codes->sizes().slice(0, lead).equals(x.sizes().slice(0, lead)),
              "codes must be (..., r) with the leading dimensions of x ", x.sizes(), ", got ", codes->sizes());
    check_contiguous(*codes, "codes");
    codes_rows = codes->view({rows, codes->size(-1)});
  }
  auto [Y, P] =
      linear_rows(x.view({rows, x.size(-1)}), weight, bias, V, codes_rows, U, scale, mode, split_k, need_p, V_t,
                  gemm_tile_n);
  std::vector<int64_t> shape(x.sizes().begin(), x.sizes().end());
  shape.back() = Y.size(1);
  return {Y.view(shape), P};
}

namespace {

// Whether this build and the current device run the GEMM with the update inside (linear mode 6).
bool fused_gemm_available() {
  int device = 0;
  C10_CUDA_CHECK(cudaGetDevice(&device));
  return sm90a_runs(device);
}

}  // namespace
}  // namespace bem

namespace bem {

void bind_lowrank(pybind11::module_& m) {
  m.def("update_forward", &bem::update_forward, "(Y, P) = (s ((x V) ⊙ codes) U^T, x V)", py::arg("x"),
        py::arg("V"), py::arg("codes"), py::arg("U"), py::arg("scaling"), py::arg("kernel") = 0,
        py::arg("stream_tokens") = 0, py::arg("stream_cluster") = 0);
  m.def("project", &bem::project, "A B in float32 (float64 for double inputs)", py::arg("A"), py::arg("B"));
  m.def("linear_forward", &bem::linear_forward, "(Y, P) = (x W^T + b + s ((x V) ⊙ codes) U^T, x V)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("V"), py::arg("codes"), py::arg("U"),
        py::arg("scaling"), py::arg("mode") = 0, py::arg("split_k") = 0, py::arg("need_p") = true,
        py::arg("V_t") = py::none(), py::arg("gemm_tile_n") = 0);
  m.def("gemm_update_given", &bem::gemm_update_given,
        "Y = x W^T + b + Pc U^T from the fused GEMM (sm_90a), W row-major (N, K) or transposed (K, N)",
        py::arg("x"), py::arg("weight"), py::arg("bias"), py::arg("Pc"), py::arg("U"), py::arg("tile_n") = 0);
  m.def("gemm_update_given_takes", &bem::gemm_update_given_takes,
        "whether gemm_update_given takes these operands as they are (no bias) on this build and device",
        py::arg("x"), py::arg("weight"), py::arg("U"));
  m.def("backward_dx_in_gemm", &bem::backward_dx_in_gemm,
        "whether the prefill backward's dX comes from the fused GEMM (measured rule) for dY, W^T and V",
        py::arg("grad_y"), py::arg("weight_t"), py::arg("V"));
  m.def("decode_backward", &bem::decode_backward,
        "(dX, dV, dcodes, dU) of the BEM linear (weight given) or of the update, for 1..64 rows",
        py::arg("x"), py::arg("grad_y"), py::arg("weight"), py::arg("V"), py::arg("U"), py::arg("P"), py::arg("codes"),
        py::arg("scaling"));
  m.def("prefill_backward", &bem::prefill_backward,
        "(dX, dV, dcodes, dU) of the BEM linear above decode sizes (dV, dU None where not asked for)", py::arg("x"),
        py::arg("grad_y"), py::arg("weight"), py::arg("V"), py::arg("U"), py::arg("P"), py::arg("codes"),
        py::arg("scaling"), py::arg("dx_in_gemm"), py::arg("need_v") = true, py::arg("need_u") = true);
  m.def("backward_coefficients", &bem::backward_coefficients,
        "(s G ⊙ codes, s P ⊙ codes, s G ⊙ P) in dtype from float32 G and P", py::arg("G"), py::arg("P"),
        py::arg("codes"), py::arg("scaling"), py::arg("dtype"));
  m.def("fused_gemm_available", &bem::fused_gemm_available,
        "whether the GEMM with the update inside (linear mode 6, sm_90a) runs on the current device");
  m.attr("DECODE_MAX_TOKENS") = bem::kDecodeMaxTokens;
  m.attr("DECODE_AUTO_MAX_TOKENS") = bem::kDecodeAutoMaxTokens;
  m.attr("MAX_FUSED_RANK") = bem::kMaxFusedRank;
  bem::bind_linear_autograd(m);
}

}  // namespace bem
