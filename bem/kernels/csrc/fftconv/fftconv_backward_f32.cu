// The backward kernels for float rows (fftconv_backward.cuh).
#include "fftconv_backward.cuh"

namespace bem {
namespace fftconv {

template int backward_blocks_typed<float>(int, int64_t, int, BackwardPass, bool);
template cudaError_t launch_backward_typed<float>(int, const BackwardArgs&, int, cudaStream_t);

}  // namespace fftconv
}  // namespace bem
