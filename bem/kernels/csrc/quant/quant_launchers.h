// Host-side entry points of the kernels for quantized frozen weights, in plain CUDA types (the torch bindings
// live in quant_bindings.cpp).
#pragma once

#include <cuda_runtime.h>

#include <cstdint>

#include "../common/dtype.h"

namespace bem {

// The decode kernel takes up to this many rows of x (tokens); more go to the dequantizing path.
constexpr int kQuant4DecodeMaxTokens = 16;

// Y = x dequant(W)^T + b + s ((x V) ⊙ codes) U^T for a 4-bit weight in bitsandbytes' layout, at decode sizes.
// W (N x K) is packed two values per byte along its flattened rows, the first in the high nibble; value e of the
// flattened weight is code[nibble] * absmax(e / blocksize), where absmax is float32 per block, or, with double
// quantization, code2[absmax_u8[b]] * absmax2[b / blocksize2] + offset. P = x V (M x r, float32) comes in
// computed; codes (M x r) may be null. K is a multiple of 32 and blocksize of 32 (each thread's eight values
// then share one block).
struct Quant4DecodeArgs {
  const void* x;           // M x K, T
  const uint8_t* W;        // N * K / 2 bytes
  const float* absmax;     // float32 absmax per block, or null when absmax_u8 is given
  const uint8_t* absmax_u8;
  const float* absmax2;    // per blocksize2 blocks of absmax_u8
  const float* code2;      // 256 values
  float offset;
  const float* code;       // 16 values
  const void* bias;        // N, T, or null
  const float* P;          // M x r
  const void* codes;       // M x r, T, or null
  const void* U;           // N x r, T
  void* Y;                 // M x N, T
  int M, N, K, r;
  int blocksize, blocksize2;
  float scale;
  int rows_per_warp;       // 1, 2 or 4 (quant4_rows_per_warp)
};
// Rows of W per warp: the most (up to 4, sharing each load of x) that still give every multiprocessor two blocks.
int quant4_rows_per_warp(int N, int num_sms);
cudaError_t launch_quant4_decode(DType dtype, const Quant4DecodeArgs& args, cudaStream_t stream);

// W (N x K, 16-bit) = the 4-bit weight of Quant4DecodeArgs' layout, dequantized (numel = N * K, a multiple of 8).
struct Quant4DequantArgs {
  const uint8_t* W;        // numel / 2 bytes
  const float* absmax;     // as in Quant4DecodeArgs
  const uint8_t* absmax_u8;
  const float* absmax2;
  const float* code2;
  float offset;
  const float* code;
  void* out;               // numel values, T, 16-byte aligned
  int64_t numel;
  int blocksize, blocksize2;
};
cudaError_t launch_quant4_dequantize(DType dtype, const Quant4DequantArgs& args, int num_sms, cudaStream_t stream);

}  // namespace bem
