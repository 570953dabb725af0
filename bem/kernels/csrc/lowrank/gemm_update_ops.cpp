// The torch side of the GEMM with the update inside: the measured limits of the default dispatch, the
// checks, and the launch (see gemm_update_ops.h).
#include "gemm_update_ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>

#include <atomic>
#include <string>

#include "../common/device_info.h"
#include "launchers.h"
#include "projection.h"
#include "host_checks.h"

namespace bem {
namespace {

// Where the GEMM with the update inside measured faster than cuBLAS with a separate update (linear mode
// 3), on an H200 (docs/kernels.md), x F.linear at M = 16384 (M = 4096 alike): K x N up to 4096 x 4096 at
// r = 8 (4096²: 1.09x against 1.13x; 2048²: 1.12x against 1.24x), up to 2048 x 2048 at r <= 32 (2048²:
// 1.19x against 1.26x; 3072 x 768: 1.19x against 1.40x; 768²: 1.26x against 1.80x) and 768 x 768 at r <= 64
// (1.52x against 1.84x), once there are at least half as many 128 x 256 tiles as multiprocessors (768² at
// M = 1024, 24 tiles: 2.61x against 2.25x). Beyond those its extra P columns cost more than the separate
// update (4096² at r = 32: 1.19x against 1.14x; 2048² at r = 64: 1.38x against 1.25x).
// The same limits, measured again for weights stored as GPT-2's Conv1D stores them (the tiles of W read
// transposed), x F.linear of that layout: M = 16384, 768²: 1.22x against 1.52x (r = 8) and 1.77x (r = 32);
// 768 x 3072: 1.14x against 1.33x; 3072 x 768: 1.11x against 1.26x; 1024 x 4096: 1.17x against 1.26x;
// M = 4096, 768 x 3072: 1.18x against 1.39x; M = 1024, 1024 x 4096: 1.32x against 1.62x; ties at worst
// (768 x 2304, M = 4096: 1.51x against 1.48x).
int64_t gemm_update_max_kn(int64_t r) {
  if (r <= 8) return 4096 * 4096;
  if (r <= 32) return 2048 * 2048;
  return 768 * 768;
}

// Whether the kernel takes these operands as they are (gemm_update_fits on the tensors, before anything
// is allocated): a row-major weight, or the transpose of one.
bool gemm_update_takes(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& V,
                       const Tensor& U) {
  const int64_t K = x.size(1), N = U.size(0), r = V.size(1);
  return tensor_core_dtype(x) && K % 8 == 0 && N % 8 == 0 && r >= 1 && r % 8 == 0 && r <= kGemmUpdateMaxRank &&
         (weight.is_contiguous() || weight_is_transposed(weight)) && aligned16(x.data_ptr()) &&
         aligned16(weight.data_ptr()) &&
         aligned16(U.data_ptr()) && (!bias.has_value() || reinterpret_cast<uintptr_t>(bias->data_ptr()) % 4 == 0);
}

// Refuses, by name, what the GEMM cannot run: a device or build without the sm_90a code, or operands
// gemm_update_takes does not take (the rank read from V, or from U where s P ⊙ codes comes ready).
void check_gemm_takes(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& V,
                      const Tensor& U) {
  BEM_CHECK(sm90a_runs(x.get_device()), "the fused GEMM needs a compute capability 9.0 GPU and the ",
            "extension built for sm_90a (TORCH_CUDA_ARCH_LIST=9.0a)");
  BEM_CHECK(gemm_update_takes(x, weight, bias, V, U),
            "the fused GEMM takes a row-major weight or the transpose of one, K, N and the rank multiples of 8, "
            "rank up to ", kGemmUpdateMaxRank, " and 16-byte aligned x, weight and U; got x ", x.sizes(),
            ", weight ", weight.sizes(), " strides ", weight.strides(), ", rank ", V.size(1));
}

// Vt (with codes, and P to write) where the GEMM computes P itself, else Pc = s P ⊙ codes computed before.
GemmUpdateArgs gemm_update_args(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor* Vt,
                                const OptTensor& codes, const Tensor* Pc, const Tensor& U, Tensor& Y,
                                const Tensor& P, double scale, int64_t tile_n) {
  GemmUpdateArgs args{};
  args.X = x.data_ptr();
  args.W = weight.data_ptr();
  args.w_transposed = weight_is_transposed(weight);
  args.bias = bias.has_value() ? bias->data_ptr() : nullptr;
  args.Vt = Vt ? Vt->data_ptr() : nullptr;
  args.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  args.Pc = Pc ? Pc->data_ptr() : nullptr;
  args.U = U.data_ptr();
  args.Y = Y.data_ptr();
  args.P = P.defined() ? P.data_ptr<float>() : nullptr;
  args.M = (int)x.size(0);
  args.N = (int)U.size(0);
  args.K = (int)x.size(1);
  args.r = (int)U.size(1);
  args.num_sms = num_sms(x.get_device());
  args.tile_n = (int)tile_n;
  args.scale = (float)scale;
  return args;
}

// Where the GEMM given s P ⊙ codes (linear mode 7) measured faster than the default before it, on an
// H200 (docs/kernels.md), x F.linear: from 512 rows up to the streaming update's 1024 at rank 32 and
// above, where the separate update pass is a chain of short launches (4096², M = 512: r = 32 1.34x
// against 1.55x, r = 64 1.38x against 1.65x; 2048 x 8192, r = 32: 1.25x against 1.63x; 4096 x 14336 and
// 14336 x 4096 within 2%). At 256 rows it only tied, at rank 16 the clustered streaming update stays
// ahead (M = 256: 1.49x against 1.79x), and from 1024 rows the default ties it. With fewer 128 x 128 tiles
// than half the multiprocessors and a long K each tile's loop is too long a chain (Conv1D weights,
// M = 512, r = 32: 3072 x 768, 24 tiles: 3.22x against 2.59x; 4096 x 1024, 32 tiles: 2.99x against
// 2.25x), and where it still won there it won little (768², 24 tiles: 2.70x against 2.95x).
constexpr int64_t kProjectedMinRows = 512, kProjectedMaxRows = 1023, kProjectedMinRank = 32;

// Where the 256-column tiles would leave more than half the multiprocessors idle, the 128-column ones
// (chosen by gemm_update_tile_n) measured faster than the separate update at r = 8 and K up to 4096 once
// they number at least 2/3 of the multiprocessors, on an H200 (docs/kernels.md), x F.linear: 2048²,
// M = 1024 (128 tiles): 1.26x against 1.46x; 4096², M = 384 (96 tiles): 1.37x against 1.47x; ties at
// 512 rows of 4096² and 3072². Slower with fewer tiles (2048², M = 512, 64: 1.85x against 1.73x), a long
// K (14336 x 4096, M = 512: 1.24x against 1.12x) or r = 16 (768 x 3072²: 1.86x against 1.42x).
constexpr int64_t kNarrowMaxRank = 8, kNarrowMaxK = 4096;

// Short prompts (a batch of one, up to a couple of thousand tokens) are bound by the host, not the GPU: the
// model's Python and each call's launches take longer than its kernels. There the one launch of the GEMM
// with the update inside is what counts, not its device time. Host time to issue one call on an H100
// machine (scripts/host_cost.py, 1024 rows, the five profile configs' shapes): the GEMM with the update
// inside 8.6-11.7 us at r = 8, 16 and 32; cuBLAS with the separate update (mode 3) 20-27 us at r = 8 and 16,
// 45-60 us at r = 32 (two more GEMMs and a scaling kernel); F.linear alone 14-19 us. Its device time there
// was below mode 3's or within 2.6 us of it at r = 8 up to K x N = 8192 x 2048 (576²: 6.3 against 8.6 us;
// 8192 x 2048: 53.4 against 59.5; 3072 x 768: 21.1 against 18.5), 4.5-8 us above at 8960 x 1536 (r = 8 to
// 32), but 10-17 us above for Phi-3-mini's wide layers (3072 x 9216: 122.6 against 108.3 at r = 8; 8192 x
// 3072: 97.9 against 88.1), whose calls are long enough to keep the GPU the bound: those keep the rules
// above. Where mode 7 is the default (a few hundred rows from rank 32) it stays so: not measured against
// this rule. Under CUDA-graph capture a replay pays no host time per call, so there the rules chosen by
// device time decide alone.
constexpr int64_t kHostBoundMaxRows = 2048, kHostBoundMaxWork = int64_t(1) << 34, kHostBoundMaxRank = 32;

}  // namespace

GemmUpdateChoice gemm_update_choice(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& V,
                                    const Tensor& U) {
  const int64_t M = x.size(0), K = x.size(1), N = U.size(0), r = V.size(1);
  if (!gemm_update_takes(x, weight, bias, V, U) || !sm90a_runs(x.get_device())) return GemmUpdateChoice::kNone;
  const int sms = num_sms(x.get_device());
  const bool wide = gemm_update_fills_wide((int)M, (int)N, sms);  // enough tiles, whichever width runs
  const bool narrow = !wide && r <= kNarrowMaxRank && K <= kNarrowMaxK &&
                      3 * gemm_update_tiles((int)M, (int)N, 128) >= 2LL * sms;
  if ((wide || narrow) && K * N <= gemm_update_max_kn(r)) return GemmUpdateChoice::kInside;
  if (M >= kProjectedMinRows && M <= kProjectedMaxRows && r >= kProjectedMinRank &&
      2 * gemm_update_tiles((int)M, (int)N, 128) >= sms)
    return GemmUpdateChoice::kProjected;
  if (M <= kHostBoundMaxRows && M * K * N <= kHostBoundMaxWork && r <= kHostBoundMaxRank && !capturing_now())
    return GemmUpdateChoice::kInside;
  return GemmUpdateChoice::kNone;
}

std::tuple<Tensor, Tensor> gemm_update_linear(const Tensor& x, const Tensor& weight, const OptTensor& bias,
                                              const Tensor& V, const OptTensor& codes, const Tensor& U, double scale,
                                              bool projected, bool need_p, const Tensor* Vt, int64_t tile_n) {
  check_gemm_takes(x, weight, bias, V, U);
  const int64_t M = x.size(0), N = U.size(0), r = V.size(1);
  Tensor Y = at::empty({M, N}, x.options());
  if (projected) {
    auto [P, Pc] = scaled_projection(x, V, codes, scale);
    const GemmUpdateArgs args =
        gemm_update_args(x, weight, bias, nullptr, c10::nullopt, &Pc, U, Y, Tensor(), scale, tile_n);
    C10_CUDA_CHECK(launch_gemm_update(dtype_of(x), args, stream_now()));
    return {Y, need_p ? P : Tensor()};
  }
  Tensor P = need_p ? at::empty({M, r}, x.options().dtype(at::kFloat)) : Tensor();
  const Tensor Vt_used = Vt ? *Vt : V.t().contiguous();  // r x K: K-major, like x and the weight
  const GemmUpdateArgs args = gemm_update_args(x, weight, bias, &Vt_used, codes, nullptr, U, Y, P, scale, tile_n);
  C10_CUDA_CHECK(launch_gemm_update(dtype_of(x), args, stream_now()));
  return {Y, P};
}

bool gemm_update_given_takes(const Tensor& x, const Tensor& weight, const Tensor& U) {
  if (!x.is_cuda() || x.dim() != 2 || !x.is_contiguous() || U.dim() != 2 || !U.is_contiguous() || weight.dim() != 2 ||
      weight.size(0) != U.size(0) || weight.size(1) != x.size(1) || weight.scalar_type() != x.scalar_type() ||
      U.scalar_type() != x.scalar_type() || weight.device() != x.device() || U.device() != x.device())
    return false;
  const c10::cuda::CUDAGuard guard(x.device());
  return gemm_update_takes(x, weight, c10::nullopt, U, U) && sm90a_runs(x.get_device());
}

// Where the backward's dX = dY W + (s G ⊙ codes) V^T from the fused GEMM (W read transposed) measured faster
// than the update kernels on dY with cuBLAS adding dY W, on an H200 (scripts/backward_sweep.py,
// docs/kernels.md), forward + backward x the frozen linear's: from 512 to 1023 rows at r >= 16 (4096²,
// M = 512: r = 32 1.40x against 1.62x, r = 64 1.48x against 1.75x; 14336 x 4096, r = 32: 1.24x against
// 1.30x), and where K x N is at most 2048² from r = 16 (768², M = 16384, r = 32: 1.62x against 1.93x; 2048²,
// M = 1024, r = 32: 1.93x against 2.07x), or at r = 8 once its 128-column tiles are at least as many as the
// multiprocessors (768², M = 16384: 1.59x against 1.71x; fewer tiles tied or lost: 2048², M = 640, 80
// tiles: 2.06x against 1.98x). At 128 rows its few tiles lost (4096², r = 8: 1.86x against 1.53x), and
// from 1024 rows on larger K x N it tied or lost (14336 x 4096, M = 16384: 1.18x against 1.10x).
constexpr int64_t kDxGemmMinRows = 512, kDxGemmMaxRows = 1023, kDxGemmMinRank = 16, kDxGemmSmallKN = 2048 * 2048;

bool backward_dx_in_gemm(const Tensor& grad_y, const Tensor& weight_t, const Tensor& V) {
  if (!gemm_update_given_takes(grad_y, weight_t, V)) return false;
  const int64_t M = grad_y.size(0), K = weight_t.size(0), N = weight_t.size(1), r = V.size(1);
  if (M >= kDxGemmMinRows && M <= kDxGemmMaxRows && r >= kDxGemmMinRank) return true;
  const bool filled = gemm_update_tiles((int)M, (int)K, 128) >= num_sms(grad_y.get_device());
  return K * N <= kDxGemmSmallKN && (r >= kDxGemmMinRank || filled);
}

namespace {

// The prefill backward's dX path as forced by custom_ops.prefill_dx_path: -1 none, 0 update, 1 GEMM. Atomic: the
// autograd engine's device thread reads what the Python thread set.
std::atomic<int> forced_dx_path{-1};

}  // namespace

void set_prefill_dx_path(int64_t path) {
  BEM_CHECK(path >= -1 && path <= 1, "the prefill dX path must be -1 (by rule), 0 (update) or 1 (GEMM), got ", path);
  forced_dx_path.store(static_cast<int>(path));
}

bool prefill_dx_in_gemm(const Tensor& grad_y, const Tensor& weight_t, const Tensor& V) {
  const int path = forced_dx_path.load();
  if (path < 0) return backward_dx_in_gemm(grad_y, weight_t, V);
  BEM_CHECK(path == 0 || gemm_update_given_takes(grad_y, weight_t, V),
            "the fused GEMM does not take this backward's operands (it needs an sm_90a build on a compute capability "
            "9.0 GPU, float16/bfloat16, a row-major weight, K, N and the rank multiples of 8, rank up to 64); got dY ",
            shape_text(grad_y.sizes()), " ", grad_y.scalar_type(), ", weight ", shape_text(weight_t.t().sizes()),
            " strides ", shape_text(weight_t.t().strides()), ", V ", shape_text(V.sizes()));
  return path == 1;
}

Tensor gemm_update_given(const Tensor& x, const Tensor& weight, const OptTensor& bias, const Tensor& Pc,
                         const Tensor& U, int64_t tile_n) {
  BEM_CHECK(x.is_cuda(), "x must be a CUDA tensor, got one on ", x.device());
  BEM_CHECK(x.dim() == 2, "x must be 2-D (M, K), got shape ", x.sizes());
  BEM_CHECK(tensor_core_dtype(x), "the fused GEMM takes float16 or bfloat16, got ", x.scalar_type());
  check_contiguous(x, "x");
  BEM_CHECK(U.dim() == 2, "U must be 2-D (N, r), got shape ", U.sizes());
  check_like(U, "U", x);
  check_contiguous(U, "U");
  const int64_t M = x.size(0), K = x.size(1), N = U.size(0), r = U.size(1);
  check_like(Pc, "Pc", x);
  check_contiguous(Pc, "Pc");
  BEM_CHECK(Pc.dim() == 2 && Pc.size(0) == M && Pc.size(1) == r, "Pc must be (M, r) = (", M, ", ", r, "), got ",
            Pc.sizes());
  check_weight(x, weight, bias, U);
  BEM_CHECK(tile_n == 0 || tile_n == 128 || tile_n == 256, "tile_n must be 0 (chosen by shape), 128 or 256, got ",
            tile_n);
  BEM_CHECK(M >= 1 && M < INT_MAX && K < INT_MAX && N < INT_MAX, "dimensions must be 1 .. 2^31 - 1, got x ",
            x.sizes(), " and U ", U.sizes());
  const c10::cuda::CUDAGuard guard(x.device());
  check_gemm_takes(x, weight, bias, U, U);  // the rank's checks read V's columns: U's (N, r) has them too
  Tensor Y = at::empty({M, N}, x.options());
  const GemmUpdateArgs args = gemm_update_args(x, weight, bias, nullptr, c10::nullopt, &Pc, U, Y, Tensor(), 1.0, tile_n);
  C10_CUDA_CHECK(launch_gemm_update(dtype_of(x), args, stream_now()));
  return Y;
}

}  // namespace bem
