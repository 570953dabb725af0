// The extension module bem._C: each kernel family binds its functions from its own folder.
#include <torch/extension.h>

namespace bem {
void bind_lowrank(pybind11::module_& m);   // lowrank/bindings.cpp: the low-rank update and the BEM linear
void bind_fftconv(pybind11::module_& m);   // fftconv/fftconv_bindings.cpp: the long FFT convolution
void bind_mlstm(pybind11::module_& m);     // mlstm/mlstm_bindings.cpp: the mLSTM matrix memory
void bind_quant(pybind11::module_& m);     // quant/quant_bindings.cpp: linears on quantized frozen weights
}  // namespace bem

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.doc() = "BEM kernels: the low-rank update and the linears it rides on, fftconv, mLSTM, quantized linears";
  bem::bind_lowrank(m);
  bem::bind_fftconv(m);
  bem::bind_mlstm(m);
  bem::bind_quant(m);
}
