// The backward kernels for __half rows (fftconv_backward.cuh).
#include "fftconv_backward.cuh"

namespace bem {
namespace fftconv {

template int backward_blocks_typed<__half>(int, int64_t, int, BackwardPass, bool);
template cudaError_t launch_backward_typed<__half>(int, const BackwardArgs&, int, cudaStream_t);

}  // namespace fftconv
}  // namespace bem
