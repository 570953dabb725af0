"""BEM kernels: fused CUDA ops with a PyTorch reference behind one dispatch point (`ops`).

`KERNELS_AVAILABLE` tells whether the CUDA extension loaded; without it every op runs the reference.
"""

from .ops import KERNELS_AVAILABLE, bem_linear, fused_unavailable_reason, generated_update

__all__ = ["KERNELS_AVAILABLE", "bem_linear", "fused_unavailable_reason", "generated_update"]
