"""The seed's module name for the fused update: `bem.kernels.cuda_ops.fused_generated_update`."""

from .ops import generated_update as fused_generated_update

__all__ = ["fused_generated_update"]
