// Torch bindings of the backward: the decode-size backward (lowrank_grads.cu, beside cuBLAS on a pool
// stream), the prefill backward's coefficients (scale_codes.cu), and the whole prefill backward with its
// low-rank pieces in two launches where they take the call (lowrank_prefill_grads.cu).
#include "backward_ops.h"

#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>

#include <atomic>
#include <optional>
#include <vector>

#include "../common/device_info.h"
#include "gemm_update_ops.h"
#include "launchers.h"
#include "host_checks.h"
#include "update_ops.h"

namespace bem {
namespace {

// The two events that order the pool stream after the caller's stream (fork) and back (join), no timing,
// created once per thread and device: decode-size backward calls are bound by host time, and creating
// and destroying two events took part of it each call. Re-recording an event is allowed once the
// streams waiting on its previous record have enqueued their wait; inside a CUDA-graph capture the
// records and waits become the graph's edges. Never destroyed: they live as long as the thread.
struct ForkJoin {
  cudaEvent_t forked = nullptr, joined = nullptr;
};

const ForkJoin& fork_join_events(int device) {
  thread_local std::vector<ForkJoin> events;
  if (device >= (int)events.size()) events.resize(device + 1);
  ForkJoin& pair = events[device];
  if (pair.forked == nullptr) {
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&pair.forked, cudaEventDisableTiming));
    C10_CUDA_CHECK(cudaEventCreateWithFlags(&pair.joined, cudaEventDisableTiming));
  }
  return pair;
}

// Runs `alongside` on the caller's stream while `beside` runs on a pool stream: every tensor either uses is
// allocated before the fork, and the join comes before the return, so what they read may be freed after.
template <typename Main, typename Side>
void fork_join(int device, Main&& alongside, Side&& beside) {
  const c10::cuda::CUDAStream main = c10::cuda::getCurrentCUDAStream(device);
  const c10::cuda::CUDAStream side = c10::cuda::getStreamFromPool(false, device);
  const ForkJoin& events = fork_join_events(device);
  C10_CUDA_CHECK(cudaEventRecord(events.forked, main.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side.stream(), events.forked, 0));
  {
    const c10::cuda::CUDAStreamGuard on_side(side);
    beside();
  }
  alongside();
  C10_CUDA_CHECK(cudaEventRecord(events.joined, side.stream()));
  C10_CUDA_CHECK(cudaStreamWaitEvent(main.stream(), events.joined, 0));
}

// P = x V as the forward kept it, or recomputed where the forward kept none: a training step keeps x and
// the codes alone (as LoRA keeps x and A x), and one small GEMM reading x again replaces M x r float32
// values held from the forward to the backward. Called under the device guard.
Tensor kept_or_projected(const OptTensor& P, const Tensor& x, const Tensor& V) {
  const int64_t M = x.size(0), r = V.size(1);
  if (!P.has_value()) return project(x, V);
  check_p_like(*P, "P", x, "x", M, r);
  return *P;
}

// How the prefill backward's low-rank pieces run, as custom_ops.prefill_grads_path forces it: -1 the two fused
// launches where they take the call and the measured rule says so, 0 the composition (cuBLAS projections, the
// coefficient kernel, cuBLAS GEMMs), 1 the fused launches (refused where they cannot take the call). Atomic: the
// autograd engine's device threads read it.
std::atomic<int> forced_grads_path{-1};

// The fused path's outputs and workspace after its coefficient launch; dV and dU (allocated where needed) come
// from launch_prefill_weight_grads(args), which the caller places on a stream ordered after this one.
struct FusedGrads {
  Tensor low, pc, dcodes, dV, dU, ws;
  PrefillGradArgs args;
};

// Where the fused launches are taken unless forced: rank 8, and a frozen linear's work M K N up to 8192 x 2048².
// They save about five launches and four library calls a layer on the host, which bounds a small model's
// training step, and cost the device about as much: forward + backward x the frozen linear's, H100
// (scripts/backward_sweep.py --grads, fused against composed), at r = 8 and 8192 rows 576² 2.54 / 2.62, 2048²
// 1.36 / 1.36, 576 x 1536 2.08 / 1.96 and 768 x 2304 1.88 / 1.71 (7 and 17 us a call); at 4096 rows above the
// bound 2048 x 8192 1.25 / 1.28, 3072 x 9216 1.17 / 1.20 but 1536 x 8960 1.43 / 1.34 (32 us); at r = 16 576²
// 2.83 / 2.54, 2048² 1.38 / 1.33, 4096³ 1.21 / 1.22. Where the device is the bound (larger work) a loss is not
// paid back on the host, so the rule stays where the losses were a few microseconds.
constexpr int64_t kFusedGradsMaxWork = 8192LL * 2048 * 2048;

bool fused_grads_by_rule(const PrefillGradArgs& args) {
  return args.r == 8 && (int64_t)args.M * args.K * args.N <= kFusedGradsMaxWork;
}

// The coefficient launch of the fused path on the current stream, or nothing where it is not taken (the caller
// composes instead). Operands checked by the caller; under its device guard.
std::optional<FusedGrads> fused_coefficients(const Tensor& x, const Tensor& grad_y, const Tensor& V, const Tensor& U,
                                             const OptTensor& codes, double scale, bool need_v, bool need_u) {
  const int path = forced_grads_path.load();
  if (path == 0) return std::nullopt;
  PrefillGradArgs args{};
  args.X = x.data_ptr();
  args.dY = grad_y.data_ptr();
  args.V = V.data_ptr();
  args.U = U.data_ptr();
  args.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  args.M = (int)x.size(0);
  args.K = (int)x.size(1);
  args.N = (int)grad_y.size(1);
  args.r = (int)V.size(1);
  args.num_sms = num_sms(x.get_device());
  args.scale = (float)scale;
  args.need_v = need_v;
  args.need_u = need_u;
  if (!prefill_grads_fit(args)) {
    BEM_CHECK(path != 1, "the fused prefill gradients take ranks 8 and 16, K and N multiples of 8 and 16-byte "
              "aligned x, grad_y, V and U; got x ", shape_text(x.sizes()), ", grad_y ", shape_text(grad_y.sizes()),
              ", V ", shape_text(V.sizes()));
    return std::nullopt;
  }
  if (path < 0 && !fused_grads_by_rule(args)) return std::nullopt;
  FusedGrads f;
  const int64_t M = x.size(0), r = V.size(1);
  // One allocation holds the workspace and the two coefficient matrices the call keeps to itself (each 16-byte
  // aligned): at a small model's training step each allocation's host cost is comparable to a launch's.
  const int64_t ws_bytes = (prefill_grads_workspace(args) + 15) / 16 * 16;
  const int64_t coef_bytes = (M * r * x.element_size() + 15) / 16 * 16;
  f.ws = at::empty({ws_bytes + 2 * coef_bytes}, x.options().dtype(at::kByte));
  f.low = f.ws.narrow(0, ws_bytes, M * r * x.element_size()).view(x.scalar_type()).view({M, r});
  f.pc = f.ws.narrow(0, ws_bytes + coef_bytes, M * r * x.element_size()).view(x.scalar_type()).view({M, r});
  f.dcodes = at::empty({M, r}, x.options());
  if (need_v) f.dV = at::empty({x.size(1), r}, x.options());
  if (need_u) f.dU = at::empty({grad_y.size(1), r}, x.options());
  args.low = f.low.data_ptr();
  args.pc = f.pc.data_ptr();
  args.dcodes = f.dcodes.data_ptr();
  args.dV = need_v ? f.dV.data_ptr() : nullptr;
  args.dU = need_u ? f.dU.data_ptr() : nullptr;
  args.ws = f.ws.data_ptr();
  f.args = args;
  C10_CUDA_CHECK(launch_prefill_coefficients(dtype_of(x), args, stream_now()));
  return f;
}

// grad_y as the prefill backward takes it: (M, N) row-major, like x.
void check_prefill_grad_y(const Tensor& grad_y, const Tensor& x, int64_t N) {
  check_like(grad_y, "grad_y", x);
  check_contiguous(grad_y, "grad_y");
  BEM_CHECK(grad_y.dim() == 2 && grad_y.size(0) == x.size(0) && grad_y.size(1) == N, "grad_y must be (M, N) = (",
            x.size(0), ", ", N, "), got ", grad_y.sizes());
}

}  // namespace

void set_prefill_grads_path(int64_t path) {
  BEM_CHECK(path >= -1 && path <= 1, "the prefill gradients' path must be -1 (by the measured rule), 0 (composed) "
            "or 1 (fused), got ", path);
  forced_grads_path.store(static_cast<int>(path));
}

// The backward at decode sizes: (dX, dV, dcodes, dU) with dX = dY W + s (G ⊙ c) V^T (without W: the
// update's share alone), dV = s x^T (G ⊙ c), dcodes = s G ⊙ P, dU = s dY^T (P ⊙ c), G = dY U. The two
// low-rank launches (lowrank_grads.cu) run on a pool stream beside cuBLAS's dY W; one addition joins
// them. On an H200 at M = 1, 4096², the two took 3.7 and 5.0 us against dY W's 10 us.
// x: (M, K), grad_y: (M, N), weight: (N, K) (any strides) or None, V: (K, r), U: (N, r), P = x V: (M, r)
// float32 or None (recomputed), codes: (M, r) or None; M <= 64.
std::tuple<Tensor, Tensor, Tensor, Tensor> decode_backward(const Tensor& x, const Tensor& grad_y, const OptTensor& weight,
                                                           const Tensor& V, const Tensor& U, const OptTensor& P_kept,
                                                           const OptTensor& codes, double scale) {
  check_update_operands(x, V, codes, U);
  BEM_CHECK(tensor_core_dtype(x), "the decode-size backward takes float16 or bfloat16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = U.size(0), r = V.size(1);
  BEM_CHECK(M >= 1 && M <= kDecodeMaxTokens, "the decode-size backward takes 1..", kDecodeMaxTokens,
            " rows, got M = ", M);
  check_like(grad_y, "grad_y", x);
  check_contiguous(grad_y, "grad_y");
  BEM_CHECK(grad_y.dim() == 2 && grad_y.size(0) == M && grad_y.size(1) == N, "grad_y must be (M, N) = (", M, ", ",
            N, "), got ", grad_y.sizes());
  if (weight.has_value()) {
    check_like(*weight, "weight", x);
    BEM_CHECK(weight->dim() == 2 && weight->size(0) == N && weight->size(1) == K, "weight must be (N, K) = (", N,
              ", ", K, "), got ", weight->sizes());
  }
  const c10::cuda::CUDAGuard guard(x.device());
  const Tensor P = kept_or_projected(P_kept, x, V);
  Tensor C = at::empty({M, K}, x.options());  // the update's share of dX
  Tensor dV = at::empty({K, r}, x.options());
  Tensor dcodes = at::empty({M, r}, x.options());
  Tensor dU = at::empty({N, r}, x.options());
  Tensor ws = at::empty({lowrank_grads_workspace((int)M, (int)N, (int)r)}, x.options().dtype(at::kFloat));
  LowRankGradArgs args{};
  args.X = x.data_ptr();
  args.dY = grad_y.data_ptr();
  args.V = V.data_ptr();
  args.U = U.data_ptr();
  args.P = P.data_ptr<float>();
  args.codes = codes.has_value() ? codes->data_ptr() : nullptr;
  args.dV = dV.data_ptr();
  args.dU = dU.data_ptr();
  args.dcodes = dcodes.data_ptr();
  args.C = C.data_ptr();
  args.ws = ws.data_ptr<float>();
  args.M = (int)M;
  args.K = (int)K;
  args.N = (int)N;
  args.r = (int)r;
  args.scale = (float)scale;
  if (!weight.has_value()) {
    C10_CUDA_CHECK(launch_lowrank_grads_first(dtype_of(x), args, stream_now()));
    C10_CUDA_CHECK(launch_lowrank_grads_second(dtype_of(x), args, stream_now()));
    return {C, dV, dcodes, dU};
  }
  // Fork: the low-rank launches beside cuBLAS's dY W; join, then one addition. The pool stream's work
  // is ordered before everything later on this stream, so the tensors it uses are safe to free after.
  const cudaStream_t main = stream_now();
  const cudaStream_t side = c10::cuda::getStreamFromPool(false, x.get_device()).stream();
  const ForkJoin& events = fork_join_events(x.get_device());
  C10_CUDA_CHECK(cudaEventRecord(events.forked, main));
  C10_CUDA_CHECK(cudaStreamWaitEvent(side, events.forked, 0));
  C10_CUDA_CHECK(launch_lowrank_grads_first(dtype_of(x), args, side));
  C10_CUDA_CHECK(launch_lowrank_grads_second(dtype_of(x), args, side));
  Tensor dX = at::mm(grad_y, *weight);
  C10_CUDA_CHECK(cudaEventRecord(events.joined, side));
  C10_CUDA_CHECK(cudaStreamWaitEvent(main, events.joined, 0));
  dX.add_(C);
  return {dX, dV, dcodes, dU};
}

// (s G ⊙ c, s P ⊙ c, s G ⊙ P) in dtype (float16 or bfloat16) from float32 G and P (M, r) and codes (M, r)
// of that dtype or None: the backward's coefficients for dV, dU and dcodes, in one pass.
std::tuple<Tensor, Tensor, Tensor> backward_coefficients(const Tensor& G, const Tensor& P, const OptTensor& codes,
                                                         double scale, at::ScalarType dtype) {
  BEM_CHECK(G.is_cuda(), "G must be a CUDA tensor, got one on ", G.device());
  BEM_CHECK(dtype == at::kHalf || dtype == at::kBFloat16, "the coefficients are float16 or bfloat16, got ", dtype);
  BEM_CHECK(G.dim() == 2, "G must be (M, r), got shape ", G.sizes());
  check_p_like(G, "G", G, "G", G.size(0), G.size(1));
  check_p_like(P, "P", G, "G", G.size(0), G.size(1));
  if (codes.has_value()) {
    BEM_CHECK(codes->device() == G.device(), "codes is on ", codes->device(), " but G is on ", G.device());
    BEM_CHECK(codes->scalar_type() == dtype, "codes has dtype ", codes->scalar_type(), " but the coefficients are ",
              dtype);
    check_contiguous(*codes, "codes");
    BEM_CHECK(codes->sizes() == G.sizes(), "codes must be (M, r) = ", G.sizes(), ", got ", codes->sizes());
  }
  const c10::cuda::CUDAGuard guard(G.device());
  const auto options = G.options().dtype(dtype);
  Tensor g_c = at::empty(G.sizes(), options), p_c = at::empty(G.sizes(), options), g_p = at::empty(G.sizes(), options);
  C10_CUDA_CHECK(launch_backward_coefficients(dtype == at::kHalf ? DType::kHalf : DType::kBFloat16,
                                              G.data_ptr<float>(), P.data_ptr<float>(),
                                              codes.has_value() ? codes->data_ptr() : nullptr, g_c.data_ptr(),
                                              p_c.data_ptr(), g_p.data_ptr(), G.numel(), (float)scale, stream_now()));
  return {g_c, p_c, g_p};
}

// The backward above decode sizes, in one call (at a small model's training step each wrapped linear's
// backward is bound by host time: this replaces a Python composition that took about 170 us of it).
// G = dY U; the coefficient kernel gives s G ⊙ c, s P ⊙ c and dcodes = s G ⊙ P; dV = x^T (s G ⊙ c) and
// dU = dY^T (s P ⊙ c) run on a pool stream beside dX. dX either from the fused GEMM given s G ⊙ c
// (dx_in_gemm: dY W + (s G ⊙ c) V^T in one pass, W read transposed), or from the update kernels on dY
// (which give G as well) with cuBLAS adding dY W.
// x: (M, K), grad_y: (M, N) row-major, weight: (N, K) (any strides), V: (K, r), U: (N, r), P = x V: (M, r)
// float32 or None (recomputed), codes: (M, r) or None; float16 or bfloat16. dV and dU come back undefined
// (None) where not needed.
std::tuple<Tensor, Tensor, Tensor, Tensor> prefill_backward(const Tensor& x, const Tensor& grad_y,
                                                            const Tensor& weight, const Tensor& V, const Tensor& U,
                                                            const OptTensor& P_kept, const OptTensor& codes, double scale,
                                                            bool dx_in_gemm, bool need_v, bool need_u) {
  check_update_operands(x, V, codes, U);
  BEM_CHECK(tensor_core_dtype(x), "the prefill backward takes float16 or bfloat16, got ", x.scalar_type());
  const int64_t M = x.size(0), K = x.size(1), N = U.size(0), r = V.size(1);
  check_prefill_grad_y(grad_y, x, N);
  check_like(weight, "weight", x);
  BEM_CHECK(weight.dim() == 2 && weight.size(0) == N && weight.size(1) == K, "weight must be (N, K) = (", N, ", ", K,
            "), got ", weight.sizes());
  if (P_kept.has_value()) check_p_like(*P_kept, "P", x, "x", M, r);
  const c10::cuda::CUDAGuard guard(x.device());
  if (dx_in_gemm) {
    if (std::optional<FusedGrads> fused = fused_coefficients(x, grad_y, V, U, codes, scale, need_v, need_u)) {
      Tensor dX;
      fork_join(
          x.get_device(), [&] { dX = gemm_update_given(grad_y, weight.t(), c10::nullopt, fused->low, V, 0); },
          [&] { C10_CUDA_CHECK(launch_prefill_weight_grads(dtype_of(x), fused->args, stream_now())); });
      return {dX, fused->dV, fused->dcodes, fused->dU};
    }
  }
  const Tensor P = kept_or_projected(P_kept, x, V);
  Tensor dX, G;
  if (dx_in_gemm) {
    G = project(grad_y, U);
  } else {
    std::tie(dX, G) = update_forward(grad_y, U, codes, V, scale, 0, 0, 0);
  }
  auto [low, pc, dcodes] = backward_coefficients(G, P, codes, scale, x.scalar_type());
  Tensor dV = need_v ? at::empty({K, r}, x.options()) : Tensor();
  Tensor dU = need_u ? at::empty({N, r}, x.options()) : Tensor();
  fork_join(
      x.get_device(),
      [&] {
        if (dx_in_gemm) {
          dX = gemm_update_given(grad_y, weight.t(), c10::nullopt, low, V, 0);
        } else {
          dX.addmm_(grad_y, weight);
        }
      },
      [&] {
        if (need_v) at::mm_out(dV, x.t(), low);
        if (need_u) at::mm_out(dU, grad_y.t(), pc);
      });
  return {dX, dV, dcodes, dU};
}

// The prefill backward without dX (a first layer's projections, whose input needs no gradient): (dV, dcodes, dU)
// from the two fused launches where they take the call, else x V and dY U, the coefficient kernel and two GEMMs.
std::tuple<Tensor, Tensor, Tensor> prefill_weight_grads(const Tensor& x, const Tensor& grad_y, const Tensor& V,
                                                        const Tensor& U, const OptTensor& codes, double scale,
                                                        bool need_v, bool need_u) {
  check_update_operands(x, V, codes, U);
  BEM_CHECK(tensor_core_dtype(x), "the prefill backward takes float16 or bfloat16, got ", x.scalar_type());
  check_prefill_grad_y(grad_y, x, U.size(0));
  const c10::cuda::CUDAGuard guard(x.device());
  if (std::optional<FusedGrads> fused = fused_coefficients(x, grad_y, V, U, codes, scale, need_v, need_u)) {
    C10_CUDA_CHECK(launch_prefill_weight_grads(dtype_of(x), fused->args, stream_now()));
    return {fused->dV, fused->dcodes, fused->dU};
  }
  const Tensor P = project(x, V), G = project(grad_y, U);
  auto [low, pc, dcodes] = backward_coefficients(G, P, codes, scale, x.scalar_type());
  return {need_v ? at::mm(x.t(), low) : Tensor(), dcodes, need_u ? at::mm(grad_y.t(), pc) : Tensor()};
}

}  // namespace bem
