// Asks L2 for the line holding p: nothing is read into the thread (no register, no wait), so it may run
// before a dependent launch's wait (L2 is coherent) or well ahead of the load it serves. Kept free of torch
// headers (fftconv_block.cuh's host emulation includes it, where it does nothing).
#pragma once

namespace bem {

#if defined(__CUDACC__)
__device__ __forceinline__ void prefetch_l2(const void* p) { asm volatile("prefetch.global.L2 [%0];" ::"l"(p)); }
#else
inline void prefetch_l2(const void*) {}
#endif

}  // namespace bem
