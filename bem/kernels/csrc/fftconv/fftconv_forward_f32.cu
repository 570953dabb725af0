// The forward kernels for float rows (fftconv_forward.cuh).
#include "fftconv_forward.cuh"

namespace bem {
namespace fftconv {

template cudaError_t launch_forward_typed<float>(int, const ForwardArgs&, int, cudaStream_t);

}  // namespace fftconv
}  // namespace bem
