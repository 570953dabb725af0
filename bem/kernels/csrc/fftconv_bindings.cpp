// Torch bindings of the fftconv op family (filled in by its kernels).
#include <torch/extension.h>

namespace bem {

void bind_fftconv(pybind11::module_& m) { (void)m; }

}  // namespace bem
