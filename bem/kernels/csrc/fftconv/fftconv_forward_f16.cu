// The forward kernels for __half rows (fftconv_forward.cuh).
#include "fftconv_forward.cuh"

namespace bem {
namespace fftconv {

template cudaError_t launch_forward_typed<__half>(int, const ForwardArgs&, int, cudaStream_t);

}  // namespace fftconv
}  // namespace bem
