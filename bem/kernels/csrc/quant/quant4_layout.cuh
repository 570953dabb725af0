// bitsandbytes' 4-bit layout as the device reads it: the absmax of a block of the flattened weight, plain (float32
// per block) or double-quantized (an 8-bit index into code2, scaled by its own block's absmax2, plus offset).
#pragma once

#include <cstdint>

namespace bem {

// A: any argument struct with absmax, absmax_u8, code2, absmax2, blocksize2 and offset (quant_launchers.h). The
// product and the sum are rounded apart, as bitsandbytes computes them (a fused multiply-add would round once and
// could move a dequantized value by one step of its 16-bit type).
template <typename A>
__device__ __forceinline__ float block_absmax(const A& a, int64_t block) {
  if (a.absmax != nullptr) return __ldg(a.absmax + block);
  return __fadd_rn(__fmul_rn(__ldg(a.code2 + __ldg(a.absmax_u8 + block)), __ldg(a.absmax2 + block / a.blocksize2)),
                   a.offset);
}

}  // namespace bem
