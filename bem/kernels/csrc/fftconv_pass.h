// Which part of the fftconv backward one launch computes (shared by the host API, fftconv.h, and the
// kernels' bodies, fftconv_block.cuh): everything in one pass (kFused), or in up to three launches, each
// kernel holding the code of two transforms a row (the fused kernel's four outgrew the instruction cache):
// kActivation recomputes the pre-activation and writes g and dpregate (GELU, or dpostgate wanted), kInputs
// the input gradients (du, dpregate, dD), kFilter dk.
#pragma once

namespace bem {
namespace fftconv {

enum class BackwardPass : int { kFused = 0, kInputs = 1, kFilter = 2, kActivation = 3 };

}  // namespace fftconv
}  // namespace bem
