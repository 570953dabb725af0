"""The fftconv op family: Hyena's causal long convolution with its gates, D term and GELU, and its decoding
step. `fftconv` / `fftconv_step` dispatch to the CUDA kernels or to `reference`; the `*_unavailable_reason`
functions say why the reference runs. See docs/fftconv.md."""

from .dispatch import fftconv, fftconv_step, fftconv_unavailable_reason, step_unavailable_reason

__all__ = ["fftconv", "fftconv_step", "fftconv_unavailable_reason", "step_unavailable_reason"]
