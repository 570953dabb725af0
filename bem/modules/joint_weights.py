"""The frozen weight and Vᵀ in one allocation, so that the base layer's own GEMM computes x V.

For a wrapped `nn.Linear` with weight W (N x K) and rank r, the joint buffer is (N + R) x K, R = r rounded up
to a multiple of 8 (the output rows keep W's alignment): rows 0..N-1 are W itself (the layer's weight becomes a
view of them, so no second copy of W exists), rows N..N+r-1 a copy of Vᵀ, the rest zero. One
`F.linear(x, joint)` then gives `[x Wᵀ | x V]` from the base's own cuBLAS call, and the expand
`s ((x V) ⊙ c) Uᵀ` is r multiply-adds per output that torch.compile fuses into the consumer's pointwise kernel
(the residual add, SiLU times up, RoPE). generate's compiled decoding step takes this form
(`joint_linear`); every other call keeps the fused kernels, which read W once with the update inside.

`JointWeights.refresh()`, called as each `generate` starts (outside any compiled call), re-homes a weight whose
storage is no longer the joint buffer's (the model moved, a weight was replaced) and copies Vᵀ in again whenever
V was written (its version counter) or replaced (its address), as the adapter pack does for V and U.
"""

from __future__ import annotations

from collections import Counter
from typing import Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

ROW_ALIGN = 8  # Vᵀ's rows padded to a multiple of this: N + R keeps 16-byte rows of a half-precision output


def _padded_rank(r: int) -> int:
    return -(-r // ROW_ALIGN) * ROW_ALIGN


def joinable(module: nn.Module) -> bool:
    """Whether `module` (a `BEMLinear`) can take the joint form: its base is `nn.Linear`'s own product of a dense
    floating-point weight (not `Conv1D`, whose K x N weight cannot be the leading rows of an (N + R) x K buffer,
    not a quantized or sharded layer), on a real device, in V's dtype."""
    base = module._modules.get("base_layer")
    spec = getattr(module, "spec", None)
    if not isinstance(base, nn.Linear) or spec is None:
        return False
    weight = base._parameters.get("weight")
    V = module._parameters["bem_V"]
    _, _, is_conv1d, owns_product, _, _ = spec
    return (owns_product and not is_conv1d and weight is not None
            and type(weight.data) is torch.Tensor and weight.device.type != "meta" and weight.dim() == 2
            and weight.is_contiguous() and not weight.requires_grad
            and weight.dtype == V.dtype and weight.device == V.device)


class JointWeights:
    """The joint buffers of `modules` (each a `BEMLinear`); None for a module that cannot take the form."""

    def __init__(self, modules: Sequence[nn.Module]) -> None:
        self._modules = list(modules)
        self.joints: list[Optional[torch.Tensor]] = [None] * len(self._modules)
        self._seen: list[Optional[tuple[torch.Tensor, int]]] = [None] * len(self._modules)  # V copied in, its version

    def release(self) -> None:
        """Forget every joint buffer (the weights stay views of them until replaced)."""
        self.joints = [None] * len(self._modules)
        self._seen = [None] * len(self._modules)

    def unjoin(self) -> None:
        """Give each weight still in a joint buffer a storage of its own size back, and forget the buffers."""
        with torch.inference_mode(False), torch.no_grad():
            for module, joint in zip(self._modules, self.joints):
                weight = module._modules["base_layer"]._parameters.get("weight")
                if joint is not None and weight is not None and weight.data_ptr() == joint.data_ptr():
                    weight.data = weight.detach().clone()
        self.release()

    def refresh(self) -> None:
        """Bring every joint buffer (`joints`, in module order) up to date with its weight and V."""
        weights = [getattr(module._modules.get("base_layer"), "weight", None) for module in self._modules]
        # a weight that two wrapped layers share could be the leading rows of only one of their buffers
        owners = Counter(id(weight) for weight in weights if weight is not None)
        # a normal tensor even inside inference mode: the weight is a view of it and autograd may save it later
        with torch.inference_mode(False), torch.no_grad():
            for index, (module, weight) in enumerate(zip(self._modules, weights)):
                if not joinable(module) or owners[id(weight)] > 1:
                    self.joints[index], self._seen[index] = None, None
                    continue
                joint = self.joints[index]
                if joint is None or weight.data_ptr() != joint.data_ptr():
                    joint = self._rehome(module, weight)
                    self.joints[index], self._seen[index] = joint, None
                V = module._parameters["bem_V"].detach()
                seen = self._seen[index]
                if seen is None or seen[0].data_ptr() != V.data_ptr() or seen[1] != V._version:
                    N, r = weight.shape[0], V.shape[1]
                    joint[N:N + r].copy_(V.t())
                    self._seen[index] = (V, V._version)

    @staticmethod
    def _rehome(module: nn.Module, weight: nn.Parameter) -> torch.Tensor:
        """A new (N + R) x K buffer holding W and zeros; the weight's data becomes its first N rows."""
        N, K = weight.shape
        R = _padded_rank(module._parameters["bem_V"].shape[1])
        joint = torch.empty(N + R, K, dtype=weight.dtype, device=weight.device)
        joint[:N].copy_(weight.detach())
        joint[N:].zero_()
        weight.data = joint[:N]  # the old storage goes once nothing else holds it: W is never kept twice
        # a fixed address: CUDA-graph replays read it in place instead of copying it in before each replay
        torch._dynamo.mark_static_address(joint)
        return joint


def joint_linear(x: torch.Tensor, joint: torch.Tensor, out_features: int, bias: Optional[torch.Tensor],
                 codes: Optional[torch.Tensor], U: torch.Tensor, scaling: float) -> torch.Tensor:
    """`x Wᵀ + b + s ((x V) ⊙ c) Uᵀ` from the joint buffer: one GEMM for `x Wᵀ` and `x V`, then the expand as r
    multiply-adds (written out, so that the compiler fuses them with the consumer rather than launching a
    product of inner size r). x (..., K), joint (N + R, K), codes (..., r) or None, U (N, r)."""
    z = F.linear(x, joint)
    N, r = out_features, U.shape[1]
    h = z[..., N:N + r]
    h = h * scaling if codes is None else h * codes * scaling
    out = z[..., :N]
    if bias is not None:
        out = out + bias
    for j in range(r):
        out = out + h[..., j:j + 1] * U[:, j]
    return out
