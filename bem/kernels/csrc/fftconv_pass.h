// Which part of the fftconv backward one launch computes (shared by the host API, fftconv.h, and the
// kernels' bodies, fftconv_block.cuh): everything in one pass, or, when the pre-activation need not be
// recomputed, the input gradients (du, dpregate, dD) and the filter's (dk) in two launches. Each of those
// kernels holds the code of two transforms a row; the fused kernel's four outgrew the instruction cache.
#pragma once

namespace bem {
namespace fftconv {

enum class BackwardPass : int { kFused = 0, kInputs = 1, kFilter = 2 };

}  // namespace fftconv
}  // namespace bem
