// Which part of the fftconv backward one launch computes (shared by the host API, fftconv.h, and the
// kernels' bodies, fftconv_block.cuh). Up to three launches, each kernel holding the code of two transforms a
// row (one kernel with all four outgrew the instruction cache and measured 17-22% slower): kActivation
// recomputes the pre-activation and writes g and dpostgate (GELU on, or dpostgate wanted), kInputs the input
// gradients (du, dpregate, dD), kFilter dk.
#pragma once

namespace bem {
namespace fftconv {

enum class BackwardPass : int { kActivation, kInputs, kFilter };

}  // namespace fftconv
}  // namespace bem
