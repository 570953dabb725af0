// A module of the mLSTM kernels alone (bem_mlstm_dev), for work on them while the rest of csrc/ changes:
// BEM_MLSTM_DEV_MODULE=1 makes bem/kernels/mlstm/custom_ops.py build and use it instead of bem._C
// (scripts/gpu/mlstm.sh).
#include <torch/extension.h>

namespace bem {
void bind_mlstm(pybind11::module_& m);
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) { bem::bind_mlstm(m); }
