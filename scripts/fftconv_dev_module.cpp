// The fftconv kernels alone as a module (bem_fftconv_dev), for building and testing them while the other
// families' sources change: BEM_FFTCONV_DEV_MODULE=1 makes bem.kernels.fftconv build and use it
// (bem/kernels/fftconv/custom_ops.py; scripts/gpu/fftconv.sh).
#include <torch/extension.h>

namespace bem {
void bind_fftconv(pybind11::module_& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bem::bind_fftconv(m); }
