// Torch bindings of the mlstm op family (filled in by its kernels).
#include <torch/extension.h>

namespace bem {

void bind_mlstm(pybind11::module_& m) { (void)m; }

}  // namespace bem
