// What the chunk-state pass needs of each chunk's gates, for every chunk at once (one warp per chunk), so that
// the sequential walk over the chunks carries none of the gate arithmetic (a warp's scan, log σ, exp) in its
// chain of latencies. The arithmetic is the walk's own (scan_gates, wexp, wdiv), so the numbers are the same.
// Forward:
//   a_tok[t] = ĩ_t - g_t (GateT, -inf beyond the last token), chunk_gm = (G, pm[63]) (GateT): the walk forms
//   M = max(m, pm[63]) and every weight exp(a_t - M) from them and its carried stabiliser m.
// Reverse (the forward's stabilisers known):
//   w_tok[t] = exp(m_c - M_t) / √d / max(|den_t|, exp(-m_t)),  wn_tok[t] = exp(m_c - M_t) / √d · beta_t,
//   decay = exp(G + m_c - m_{c+1})   (M_t = max(m_c, pm[t]); 0 beyond the last token).
#include "mlstm_common.cuh"

namespace bem {
namespace {

using namespace mlstm;

constexpr int kScanWarps = 4;

template <typename T>
__global__ void __launch_bounds__(kScanWarps * 32) mlstm_gate_scan_kernel(const MlstmStatesParams p) {
  using G = GateT<T>;
  const MlstmShape& sh = p.shape;
  const int lane = threadIdx.x % 32;
  const int c = blockIdx.x * kScanWarps + threadIdx.x / 32, bh = blockIdx.y;
  if (c >= sh.NC) return;  // a whole warp
  const ScannedGates<T> sg = scan_gates<T>(load_chunk_gates<T>(sh, p.igate, p.fgate, bh, c));
  const int64_t chunk = (int64_t)bh * sh.NC + c;
  const int t0 = c * L + 2 * lane;
  if (!p.reverse) {
    G* a = static_cast<G*>(p.a_tok) + chunk * L;
    a[2 * lane] = sg.a0;
    a[2 * lane + 1] = sg.a1;
    if (lane == 31) {
      G* gm = static_cast<G*>(p.chunk_gm) + chunk * 2;
      gm[0] = sg.g1;
      gm[1] = sg.pm1;
    }
    return;
  }
  const float m_c = p.m_states[(int64_t)bh * (sh.NC + 1) + c];
  const G pm[2] = {sg.pm0, sg.pm1};
#pragma unroll
  for (int i = 0; i < 2; ++i) {
    const int t = t0 + i;
    const G M = gmax(static_cast<G>(m_c), pm[i]);
    float w = 0.f, wn = 0.f;
    if (t < sh.S) {
      const int64_t row = (int64_t)bh * sh.S + t;
      const float e = wexp<T>(m_c - M) * sh.scale;
      w = wdiv<T>(e, normaliser<T>(p.den_tok[row], p.m_tok[row]));
      wn = e * p.beta[row];
    }
    p.w_tok[chunk * L + 2 * lane + i] = w;
    p.wn_tok[chunk * L + 2 * lane + i] = wn;
  }
  if (lane == 31) {
    const float m_next = p.m_states[(int64_t)bh * (sh.NC + 1) + c + 1];
    p.decay[chunk] = wexp<T>(sg.g1 + m_c - m_next);
  }
}

template <typename T> cudaError_t launch(const MlstmStatesParams& p, cudaStream_t stream) {
  const dim3 grid((p.shape.NC + kScanWarps - 1) / kScanWarps, p.shape.BH);
  mlstm_gate_scan_kernel<T><<<grid, kScanWarps * 32, 0, stream>>>(p);
  return cudaGetLastError();
}

}  // namespace

cudaError_t launch_mlstm_gate_scan(DType dtype, const MlstmStatesParams& p, cudaStream_t stream) {
  return dispatch_dtype(dtype, [&](auto type) { return launch<decltype(type)>(p, stream); });
}

}  // namespace bem
