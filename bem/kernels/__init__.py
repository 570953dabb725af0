"""BEM kernels: fused CUDA ops with a PyTorch reference behind one dispatch point per op family: the low-rank
update and BEM linear (`ops`), the Hyena long convolution (`fftconv`) and the mLSTM (`mlstm`).

`KERNELS_AVAILABLE` tells whether the CUDA extension loaded; without it every op runs the reference. It is
looked up on first read (which may build the extension just in time on a CUDA machine), never at import.
`CUDA_AVAILABLE` and `fused_generated_update` are the seed's names for the same things.
"""

from .fftconv import fftconv, fftconv_step
from .mlstm import mlstm, mlstm_step
from .ops import bem_linear, fused_unavailable_reason, generated_update

fused_generated_update = generated_update  # the seed's name: s * ((X V) ⊙ codes) U^T


def __getattr__(name: str):
    if name in ("KERNELS_AVAILABLE", "CUDA_AVAILABLE"):
        from . import ops

        return ops.kernels_available()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KERNELS_AVAILABLE", "CUDA_AVAILABLE", "bem_linear", "fftconv", "fftconv_step", "fused_generated_update",
           "fused_unavailable_reason", "generated_update", "mlstm", "mlstm_step"]
