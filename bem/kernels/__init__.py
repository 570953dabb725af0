"""BEM kernels: fused CUDA ops with a PyTorch reference behind one dispatch point (`ops`)."""

from .ops import KERNELS_AVAILABLE, bem_linear, generated_update

__all__ = ["KERNELS_AVAILABLE", "bem_linear", "generated_update"]
