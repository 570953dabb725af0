// The backward kernels for __nv_bfloat16 rows (fftconv_backward.cuh).
#include "fftconv_backward.cuh"

namespace bem {
namespace fftconv {

template int backward_blocks_typed<__nv_bfloat16>(int, int64_t, int, BackwardPass, bool);
template cudaError_t launch_backward_typed<__nv_bfloat16>(int, const BackwardArgs&, int, cudaStream_t);

}  // namespace fftconv
}  // namespace bem
