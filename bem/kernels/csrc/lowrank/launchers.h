// Host-side entry points of the low-rank update's kernels, in plain CUDA types (the torch bindings live in
// bindings.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace bem {

// Largest rank the tensor-core kernels take (r is padded up to 16, 32, 64 or 128).
constexpr int kMaxFusedRank = 128;
// The decode kernel handles up to this many tokens; its split-K tile counters bound N.
constexpr int kDecodeMaxTokens = 64;
constexpr int kDecodeTileN = 128;
constexpr int kMaxDecodeTiles = 4096;

// Y (=|+=) s * ((A B) ⊙ codes) U^T (+ bias), and P = A B in fp32 (fp64 for double).
// A: M x L, B: L x r, codes: M x r or null, U: N x r, Y: M x N, P: M x r. With expand false only P
// is written (Y, U, bias unused): this is the projection `dY U` of the backward.
struct LowRankArgs {
  const void* A;
  const void* B;
  const void* codes;
  const void* U;
  const void* bias;
  void* Y;
  void* P;
  const void* P_in;  // fp32 A B computed elsewhere (skips the projection), or null
  const void* Bt;    // B^T (r x L, row-major) for the TMA kernel, or null
  int M, L, N, r;
  int num_sms;
  int stream_tokens;   // the streaming kernel's tokens per block (16, 32 or 64), 0: chosen by shape
  int stream_cluster;  // the streaming kernel's blocks per token group (1, 2, 4 or 8; sm_90), 0: by shape
  int cc_major;        // the device's compute capability (major)
  double scale;
  bool expand;
  bool accumulate;
};
cudaError_t launch_lowrank_update(DType dtype, const LowRankArgs& args, cudaStream_t stream);

// out = s * (P ⊙ codes) in fp16/bf16 (codes: count values of that dtype, or null for all ones); P is
// fp32. The step between the two cuBLAS GEMMs of the update at prefill sizes above rank 16.
cudaError_t launch_scale_codes(DType dtype, const float* P, const void* codes, void* out, int64_t count, float scale,
                               cudaStream_t stream);

// The backward's coefficients in fp16/bf16 from fp32 G = dY U and P = x V (count values each; codes of
// that dtype or null for all ones): g_c = s G ⊙ codes, p_c = s P ⊙ codes, g_p = s G ⊙ P.
cudaError_t launch_backward_coefficients(DType dtype, const float* G, const float* P, const void* codes, void* g_c,
                                         void* p_c, void* g_p, int64_t count, float scale, cudaStream_t stream);

// The prefill backward's low-rank pieces in two launches (lowrank_prefill_grads.cu, fp16/bf16, above decode
// sizes), where composed they took two cuBLAS projections, the coefficient kernel and two split-K cuBLAS GEMMs
// with their reductions:
// - coefficients: P = X V and G = dY U on the tensor cores, summed in a fixed order (never written), and from
//   them low = s G ⊙ c, pc = s P ⊙ c and dcodes = s G ⊙ P in the dtype (codes null: all ones); it also zeroes the
//   weight-gradient launch's tile counters;
// - weight gradients: dV = X^T low and dU = dY^T pc (either may be skipped: need_v, need_u), rows of X and dY
//   split over blocks whose fp32 partials (ws) the last block of each column tile sums in a fixed order: the
//   result does not depend on timing.
// prefill_grads_fit says whether they take the call: r 8 or 16, K and N multiples of 8, X, dY, V and U 16-byte
// aligned. The caller allocates low, pc and dcodes (M x r) and ws (prefill_grads_workspace bytes, 16-byte aligned).
struct PrefillGradArgs {
  const void* X;
  const void* dY;
  const void* V;
  const void* U;
  const void* codes;
  void* low;
  void* pc;
  void* dcodes;
  void* dV;
  void* dU;
  void* ws;
  int M, K, N, r;
  int num_sms;
  float scale;
  bool need_v, need_u;
};
bool prefill_grads_fit(const PrefillGradArgs& args);
int64_t prefill_grads_workspace(const PrefillGradArgs& args);  // bytes
cudaError_t launch_prefill_coefficients(DType dtype, const PrefillGradArgs& args, cudaStream_t stream);
cudaError_t launch_prefill_weight_grads(DType dtype, const PrefillGradArgs& args, cudaStream_t stream);

// The streaming update kernel (fp16/bf16, prefill sizes): lowrank_stream_fits says whether the call
// suits it (L and r multiples of 8, r <= kStreamMaxRank, A, B and U 16-byte aligned, no P_in, stream_tokens 0, 16, 32 or 64 (64 up to rank 32),
// stream_cluster 0, 1, or 2, 4, 8 where cc_major >= 9). Same outputs as launch_lowrank_update.
// lowrank_stream_tokens: the tokens per block it will use; lowrank_stream_cluster: the blocks that share
// each group of tokens (a thread-block cluster splitting K and N; 1: none).
constexpr int kStreamMaxRank = 64;
constexpr int kStreamTallBlockMaxRank = 32;  // 64-token blocks: their partial products fill the registers above
constexpr int kStreamMaxCluster = 8;
constexpr int kStreamClusterMinK = 256;  // columns of K each block of a cluster keeps at least
// Clusters by shape up to this rank. Below 1024 rows on an H200 (update alone, 4096²) they were ahead at
// r = 16 (M = 64: 7.2 us against 11.0 for the tiles kernel; M = 512: 12.1 against 13.7; M = 1024, where
// the streaming kernel ran without: 12.0 against 17.2) and behind at r = 32 (M = 256: 15.6 against 13.0
// for the two GEMMs; M = 512: 19.3 against 13.9) and r = 64 (18-30 against 14-18).
constexpr int kStreamClusterMaxRank = 16;
bool lowrank_stream_fits(const LowRankArgs& args);
int lowrank_stream_tokens(const LowRankArgs& args);
int lowrank_stream_cluster(const LowRankArgs& args);
cudaError_t launch_lowrank_stream(DType dtype, const LowRankArgs& args, cudaStream_t stream);

// The TMA update kernel (sm_90a, fp16/bf16, prefill sizes; runs where gemm_update_supported says the
// build has sm_90a code for the device): takes B^T in args.Bt; lowrank_tma_fits says whether it takes the
// call (Y written, not accumulated; L, N and r multiples of 8, r <= kLowRankTmaMaxRank; A, U and Y
// 16-byte aligned, bias 4-byte aligned; no P_in). B^T must be 16-byte aligned too. Same outputs as launch_lowrank_update.
constexpr int kLowRankTmaMaxRank = 64;
constexpr int kLowRankTmaTileRows = 64;  // rows per tile (a persistent block takes tiles in turn)
bool lowrank_tma_fits(const LowRankArgs& args);
cudaError_t launch_lowrank_tma(DType dtype, const LowRankArgs& args, cudaStream_t stream);

// Y = X W^T + b + s * ((X V) ⊙ codes) U^T for M <= kDecodeMaxTokens, one launch that reads W once.
// W is N x K row-major, or (w_transposed) the N x K view of a row-major K x N buffer. Split-K
// partials go to ws (split_k x M x N fp32) and ws_p (split_k x M x r fp32) when split_k > 1.
struct DecodeArgs {
  const void* X;
  const void* W;
  const void* bias;
  const void* V;
  const void* codes;
  const void* U;
  void* Y;
  float* P;
  float* ws;
  float* ws_p;
  void* Pc;  // the streaming kernel's s (X V) ⊙ codes: M x (r rounded up to 16) of the input dtype
  int M, N, K, r;
  float scale;
  bool w_transposed;
  int split_k;
  int k_per_split;
};
// Split-K factor for the decode kernel: enough blocks to keep every multiprocessor streaming W.
int decode_split_k(int M, int N, int K, int r, bool w_transposed, int num_sms, int requested);
int decode_k_per_split(int K, int split_k);
cudaError_t launch_decode_linear(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The streaming decode kernel (sm_90, M <= kDecodeStreamMaxTokens, r <= kDecodeStreamMaxRank, W
// row-major, K % 8 == 0, X and W 16-byte aligned), one launch, or two where
// decode_stream_projects_first (a projection before the stream): split_k is the stream's thread-block
// cluster size (1, 2, 4 or 8), k_per_split a multiple of 32; Pc is its only scratch (M x round_up(r, 16)
// values of the input dtype, needed for the projection). decode_stream_fits says whether
// it takes the call (cc_major: the device's).
constexpr int kDecodeStreamMaxTokens = 16;
constexpr int kDecodeStreamMaxRank = 64;  // the update's operands live in the first block's registers
constexpr int kDecodeStreamMaxCluster = 8;
bool decode_stream_fits(const DecodeArgs& args, int cc_major);
int decode_stream_split(int N, int K, int device);
bool decode_stream_projects_first(const DecodeArgs& args);  // after split_k and k_per_split are set
cudaError_t launch_decode_stream(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The row-split decode kernel (decode_rows.cu; sm_90, the streaming kernel's operand limits and K up to
// kDecodeRowsMaxK, no clusters): a block owns 16 rows of W over all of K. decode_rows_takes says where the
// decode dispatch prefers it to the streaming kernel.
constexpr int kDecodeRowsMaxK = 2048;
bool decode_rows_fits(const DecodeArgs& args, int cc_major);
bool decode_rows_takes(int N, int K);
cudaError_t launch_decode_rows(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The TMA decode kernel (decode_tma.cu; sm_90a, the streaming kernel's operand limits): W's stages by tensor-map
// copies into a ring, multiplied by wgmma, after the projection launch (Pc needed). split_k is its cluster size
// (1, 2, 4 or 8), k_per_split a multiple of 64 (decode_tma_k_per_split). The caller checks that the build has
// sm_90a code for the device (gemm_update_supported).
bool decode_tma_fits(const DecodeArgs& args, int cc_major);
bool decode_tma_takes(int K);  // where the decode dispatch prefers it under capture (above the row kernel's K)
int decode_tma_split(int N, int K, int device);
int decode_tma_k_per_split(int K, int split_k);
cudaError_t launch_decode_tma(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The decode kernel for a weight stored transposed (W^T row-major, K x N: GPT-2's Conv1D) on CUDA cores
// (sm_90, M <= kDecodeColumnsMaxTokens, r <= kDecodeColumnsMaxRank, N % 8 == 0, W 16-byte aligned), one
// launch: split_k is its thread-block cluster size (1, 2, 4 or 8), k_per_split any length that covers K.
constexpr int kDecodeColumnsMaxTokens = 4;  // at 8 tokens the tiles kernel was as fast or faster (H100)
constexpr int kDecodeColumnsMaxRank = 64;
bool decode_columns_fits(const DecodeArgs& args, int cc_major);
bool decode_columns_takes(const DecodeArgs& args);  // where the dispatch prefers it to the tensor-core kernel
int decode_columns_split(int M, int N, int K, int r, int device);
cudaError_t launch_decode_columns(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The tensor-core decode kernel for a weight stored transposed (decode_columns_mma.cu; sm_90, M <=
// kDecodeColumnsMmaMaxTokens, r 8 or 16, K and N multiples of 8, X, W and V 16-byte aligned), one launch: split_k
// its thread-block cluster size (1, 2, 4 or 8), k_per_split a multiple of 16 (decode_columns_mma_k_per_split).
constexpr int kDecodeColumnsMmaMaxTokens = 16;
constexpr int kDecodeColumnsMmaMaxRank = 16;
bool decode_columns_mma_fits(const DecodeArgs& args, int cc_major);
int decode_columns_mma_split(int N, int K, int r, int device);
int decode_columns_mma_k_per_split(int K, int split_k);
cudaError_t launch_decode_columns_mma(DType dtype, const DecodeArgs& args, cudaStream_t stream);

// The backward's low-rank pieces at decode sizes (M <= kDecodeMaxTokens, fp16/bf16), in two launches
// (the second after the first): dU = s dY^T (P ⊙ c) (N x r), dV = s X^T (G ⊙ c) (K x r),
// dcodes = s G ⊙ P (M x r) and C = s (G ⊙ c) V^T (M x K, the update's share of dX), with G = dY U summed
// in fp32 from partial sums in ws (lowrank_grads_workspace(M, N, r) floats). P = X V in fp32 (M x r),
// codes M x r or null (all ones). All row-major and contiguous.
struct LowRankGradArgs {
  const void* X;   // M x K
  const void* dY;  // M x N
  const void* V;   // K x r
  const void* U;   // N x r
  const float* P;
  const void* codes;
  void* dV;
  void* dU;
  void* dcodes;
  void* C;
  float* ws;
  int M, K, N, r;
  float scale;
};
int64_t lowrank_grads_workspace(int M, int N, int r);
cudaError_t launch_lowrank_grads_first(DType dtype, const LowRankGradArgs& args, cudaStream_t stream);
cudaError_t launch_lowrank_grads_second(DType dtype, const LowRankGradArgs& args, cudaStream_t stream);

// Y = X W^T + b + s * ((X V) ⊙ codes) U^T as one Hopper GEMM with the update inside (fp16/bf16, W
// row-major N x K or K x N, Vt = V^T row-major r x K): gemm_update_fits says whether it takes the call (K, N and
// r multiples of 8, r <= kGemmUpdateMaxRank, X, W, Vt, U and Y 16-byte aligned, bias 4-byte aligned), gemm_update_supported
// whether the build has its sm_90a code for the device. P (M x r fp32) is written when not null.
struct GemmUpdateArgs {
  const void* X;
  const void* W;  // N x K row-major, or K x N row-major where w_transposed
  bool w_transposed;
  const void* bias;
  const void* Vt;
  const void* codes;
  const void* Pc;  // s (X V) ⊙ codes (M x r) computed beforehand, or null: then Vt and codes give it
  const void* U;
  void* Y;
  float* P;
  int M, N, K, r;
  int num_sms;  // the persistent kernel's grid
  int tile_n;   // the tiles' columns: 128, 256, or 0 (gemm_update_tile_n)
  float scale;
};
constexpr int kGemmUpdateMaxRank = 64;
bool gemm_update_fits(const GemmUpdateArgs& args);
long long gemm_update_tiles(int M, int N, int tile_n);  // the kernel's output tiles of 128 x tile_n
// Whether 256-column tiles number at least half the multiprocessors (enough tiles, whichever width runs).
bool gemm_update_fills_wide(int M, int N, int num_sms);
// 128-column tiles where 256-column ones would number less than half the multiprocessors, or where they
// fill the grid's waves better (a 256-column tile costing about 1.7 of them); else 256.
int gemm_update_tile_n(int M, int N, int num_sms);
cudaError_t gemm_update_supported(int device, cudaStream_t stream, bool* supported);
cudaError_t launch_gemm_update(DType dtype, const GemmUpdateArgs& args, cudaStream_t stream);

}  // namespace bem
