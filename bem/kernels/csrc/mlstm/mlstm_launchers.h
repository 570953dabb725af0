// Host-side entry points of the mLSTM kernels, in plain CUDA types (the torch bindings are in
// mlstm_bindings.cpp). One flat params struct per kernel.
//
// Layouts (BH = B * NH rows, contiguous): q, k [BH][S][DK]; v, h, dh [BH][S][DV]; gates [BH][S] of the
// inputs' dtype or float32 (gates_fp32); per-token m, den, beta float32 [BH][S]. Chunks of kMlstmChunk
// tokens, NC = ceil(S / kMlstmChunk), the last one partial. Chunk states: C [BH][NC][DK][DV] of the state
// dtype (bfloat16 for bfloat16 inputs, else float32), n [BH][NC][DK] and m [BH][NC + 1] float32.
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace bem {

constexpr int kMlstmChunk = 64;

struct MlstmShape {
  int BH, S, DK, DV, NC;
  float scale;      // 1 / sqrt(DK)
  bool gates_fp32;  // gates are float32 (else the dtype of q)
  // 16-byte loads and cp.async: rows of q / k (DK) and v / dh / h (DV) and the bases 16-byte aligned
  bool vec_qk, vec_v, vec_state;
};

// The chunk-state pass, one block per (row, 64 rows x state_cols columns of the state), walking the chunks in
// order.
// Forward (reverse false): keys = K, values = V; writes the state entering each chunk (C_states, n_states,
// m_states[0..NC]) and the last state (C_out, n_out, m_out), starting from (C_in, n_in, m_in) or zeros.
// Reverse: keys = Q, values = dH, from the last chunk back; C_states / n_states get the gradient of the
// state after each chunk, C_out / n_out that of the initial state, starting from the gradient of the
// last state (C_in, n_in) or zeros. The gate scan (same params, launched first) reads the gates and, in reverse,
// m_states, m_tok, den_tok and beta; the pass reads what it wrote (a_tok and chunk_gm, or w_tok, wn_tok, decay).
struct MlstmStatesParams {
  MlstmShape shape;
  bool reverse;
  int state_cols;  // columns of DV per block: 16, 32 or 64 (mlstm_state_cols)
  const void* keys;
  const void* values;
  const void* igate;
  const void* fgate;
  const float* m_tok;
  const float* den_tok;
  const float* beta;
  const float* C_in;
  const float* n_in;
  const float* m_in;
  void* C_states;
  float* n_states;
  float* m_states;
  float* C_out;
  float* n_out;
  float* m_out;
  // Written by the gate scan (launch_mlstm_gate_scan), read by the state pass; [BH][NC][64] per token and
  // [BH][NC] per chunk. Forward: a_tok (GateT: double for float32 inputs, else float) and chunk_gm (GateT pairs
  // G, pm[63]). Reverse: w_tok, wn_tok and decay, float32.
  void* a_tok;
  void* chunk_gm;
  float* w_tok;
  float* wn_tok;
  float* decay;
};

// The outputs: one block per (chunk, 64 columns of h, row): h from the chunk's own tokens and the state
// entering it; m_tok and den_tok (per token; may be null) for the backward.
struct MlstmOutputsParams {
  MlstmShape shape;
  const void* q;
  const void* k;
  const void* v;
  const void* igate;
  const void* fgate;
  const void* C_states;
  const float* n_states;
  const float* m_states;
  void* h;
  float* m_tok;
  float* den_tok;
};

// The backward within chunks: dq and dk per (chunk, 64 columns of DK, row), dv per (chunk, 64 columns of
// DV, row). R_states / Rn_states: the gradient of the state after each chunk (the reverse state pass).
// qdq / kdk: [DK tiles][BH][S] partial sums of q·dq and k·dk over each tile's 64 columns.
struct MlstmGradParams {
  MlstmShape shape;
  const void* q;
  const void* k;
  const void* v;
  const void* dh;
  const void* igate;
  const void* fgate;
  const float* m_tok;
  const float* den_tok;
  const float* beta;
  const void* C_states;
  const float* n_states;
  const float* m_states;
  const void* R_states;
  const float* Rn_states;
  void* dq;
  void* dk;
  void* dv;
  float* qdq;
  float* kdk;
};

// beta [rows] (float32) from dh, h [rows][DV] (the inputs' dtype) and m_tok, den_tok [rows]: the gradient of
// each token's stabilised denominator (mlstm_beta.cu). vec: 16-byte loads (rows of 16-byte multiples, aligned).
struct MlstmBetaParams {
  int64_t rows;
  int DV;
  bool vec;
  const void* dh;
  const void* h;
  const float* m_tok;
  const float* den_tok;
  float* beta;
};

// One token per row from the float32 state (C [BH][DK][DV], n [BH][DK], m [BH]) into a new one.
struct MlstmStepParams {
  int BH, DK, DV;
  float scale;
  bool gates_fp32;
  const void* q;
  const void* k;
  const void* v;
  const void* igate;
  const void* fgate;
  const float* C;
  const float* n;
  const float* m;
  void* h;
  float* C_out;
  float* n_out;
  float* m_out;
};

// The state pass's columns of DV per block for this shape on `sms` multiprocessors.
int mlstm_state_cols(int BH, int DK, int DV, int sms);

// Every chunk's gate scan for the state pass that follows with the same params (mlstm_gate_scan.cu).
cudaError_t launch_mlstm_gate_scan(DType dtype, const MlstmStatesParams& p, cudaStream_t stream);
cudaError_t launch_mlstm_states(DType dtype, const MlstmStatesParams& p, cudaStream_t stream);
cudaError_t launch_mlstm_outputs(DType dtype, const MlstmOutputsParams& p, cudaStream_t stream);
cudaError_t launch_mlstm_grads(DType dtype, const MlstmGradParams& p, cudaStream_t stream);
cudaError_t launch_mlstm_beta(DType dtype, const MlstmBetaParams& p, cudaStream_t stream);
cudaError_t launch_mlstm_step(DType dtype, const MlstmStepParams& p, cudaStream_t stream);

}  // namespace bem
