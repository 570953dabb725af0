"""Every wrapped layer's V and U in one buffer, for `generate`'s compiled decoding step.

A compiled call takes each tensor it reads from a module as an input of its own, and pays for each one on
every call: its guards (the tensor's dtype, device, shape, strides and five dynamic-dimension markings), the
bytecode that gathers it, and CUDA-graph replay's check of its address. A model with 210 wrapped linears
brings 420 such tensors besides the base's ~270 (SmolLM-135M's shapes). Inside `generate`, BEM's no-grad
compiled calls read V and U as views of this one buffer instead: one input.

The buffer is a copy. `refresh()`, called as each `generate` starts (outside any compiled call), copies the
parameters in again whenever one of them was written (its version counter) or replaced (its address; the pack
holds the storage it copied from, so a replacement cannot land at the same address) since the last copy, so a
compiled call never reads adapters older than the parameters. The buffer keeps its
address, which CUDA-graph replays rely on, for as long as the adapters keep their dtype, device and shapes.

With `joint=True` the pack also keeps each plain `nn.Linear`'s weight and Vᵀ in one buffer (`joint_weights`), the
layers that take one input (`groups`) in one buffer together, and the compiled step computes each group as one GEMM
plus a fused expand.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
import torch.nn as nn

from .joint_weights import JointSlot, JointWeights

ALIGN = 64  # elements: each view starts 128-byte aligned (or more) in the buffer, as the kernels' loads want


class AdapterPack:
    """One buffer holding the V and U of `modules` (each with `bem_V` (K, r) and `bem_U` (N, r))."""

    def __init__(self, modules: Sequence[nn.Module], joint: bool = True,
                 groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        self._modules = list(modules)
        self.joint_weights: Optional[JointWeights] = JointWeights(self._modules, groups) if joint else None
        self.flat: Optional[torch.Tensor] = None
        # (V's offset, K, U's offset, N, r) per module, in module order: constants of the compiled call
        self.layout: tuple[tuple[int, int, int, int, int], ...] = ()
        # what was copied in: each parameter's storage (held, so its address cannot be reused by a replacement)
        # and its version counter at the copy
        self._seen: Optional[list[tuple[torch.Tensor, int]]] = None

    def _parameters(self) -> list[torch.Tensor]:
        return [p for m in self._modules for p in (m._parameters["bem_V"], m._parameters["bem_U"])]

    def _packable(self, params: list[torch.Tensor]) -> bool:
        """Plain dense (K, r) and (N, r) tensors of one floating dtype on one device: not sharded or flattened
        (FSDP, DeepSpeed), not a tensor subclass (DTensor), not on the meta device."""
        first = params[0]
        if not first.is_floating_point() or first.device.type == "meta":
            return False
        if any(type(p.data) is not torch.Tensor or p.dtype != first.dtype or p.device != first.device
               or p.dim() != 2 for p in params):
            return False
        return all(m._parameters["bem_V"].shape[1] == m._parameters["bem_U"].shape[1] for m in self._modules)

    def refresh(self) -> bool:
        """Bring the buffer up to date with the parameters. False (and no buffer) where the adapters are not
        plain (K, r) and (N, r) tensors of one floating dtype on one device: the compiled call then reads the
        parameters."""
        params = self._parameters()
        if not params or not self._packable(params):
            self.flat, self._seen = None, None
            if self.joint_weights is not None:
                self.joint_weights.release()
            return False
        if self.joint_weights is not None:
            self.joint_weights.refresh()
        layout, size = [], 0
        for m in self._modules:
            (K, r), N = m._parameters["bem_V"].shape, m._parameters["bem_U"].shape[0]
            v_at = size
            size += -(-K * r // ALIGN) * ALIGN
            layout.append((v_at, K, size, N, r))
            size += -(-N * r // ALIGN) * ALIGN
        layout_t, first = tuple(layout), params[0]
        flat = self.flat
        if flat is None or layout_t != self.layout or flat.dtype != first.dtype or flat.device != first.device:
            flat = torch.zeros(size, dtype=first.dtype, device=first.device)
            # a fixed address: CUDA-graph replays read it in place instead of copying it in before each replay
            torch._dynamo.mark_static_address(flat)
            self.flat, self.layout, self._seen = flat, layout_t, None
        seen = self._seen
        if seen is None or any(p.data_ptr() != held.data_ptr() or p._version != version
                               for p, (held, version) in zip(params, seen)):
            sources = [p.detach() for p in params]
            with torch.no_grad():  # the views in the parameters' order: V, U of each module
                torch._foreach_copy_([view for V, U, _ in self.weights() for view in (V, U)], sources)
            self._seen = [(t, t._version) for t in sources]
        return True

    def weights(self) -> list[tuple[torch.Tensor, torch.Tensor, Optional[JointSlot]]]:
        """(V, U, joint) of each module: V and U views of the buffer (traced into the compiled call as slices of
        one input), joint where it reads its outputs in its group's [W; Vᵀ] product, or None."""
        flat = self.flat
        joints = self.joint_weights.slots({}) if self.joint_weights is not None else [None] * len(self.layout)
        return [(flat[v_at:v_at + K * r].view(K, r), flat[u_at:u_at + N * r].view(N, r), joint)
                for (v_at, K, u_at, N, r), joint in zip(self.layout, joints)]
