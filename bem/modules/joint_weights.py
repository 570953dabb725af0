"""The frozen weights and their Vᵀ in one allocation, so that the base's own GEMM computes x V.

For wrapped `nn.Linear` layers with weights W_i (N_i x K) and ranks r_i that take the same input (a group: an
attention block's q, k and v, a gated MLP's gate and up; any other layer alone), the joint buffer is
(ΣN_i + R) x K, R = Σr_i rounded up to a multiple of 8 (the output rows keep W's alignment): first every W_i
itself (each layer's weight becomes a view of its rows, so no second copy of W exists), then a copy of each V_iᵀ,
the rest zero. One `F.linear(x, joint)` then gives `[x W_1ᵀ | ... | x V_1 | ...]` from one cuBLAS call, fewer
launches than the base's own. Each layer's expand `s ((x V_i) ⊙ c) U_iᵀ` is written for the kernel that consumes
it: in a group (q, k, v; gate, up) as r_i multiply-adds per output, which torch.compile fuses into the consumer's
pointwise kernel (SiLU times up, RoPE, the cache write); for a layer alone (an attention output, a down
projection: a residual branch, whose consumer is the residual add and the next norm's reduction) as a product of
inner size r_i, a kernel of its own (`EXPAND_APART`). Fused into the norm's reduction, the expand runs in the
reduction's thread blocks: one block at batch 1. generate's compiled decoding step takes this form
(`joint_linear`); every other call keeps the fused kernels, which read W once with the update inside.

A group is a guess from the layers' names (`SHARED_INPUT`), checked on every call: the first layer of a group
called with an input computes the whole group's product and keeps it for the call (`JointSlot.memo`); a later
layer of the group takes its columns only if it is called with that same tensor, and computes the product again
otherwise. A wrong guess costs a product, never an answer.

`JointWeights.refresh()`, called as each `generate` starts (outside any compiled call), re-homes the weights of a
group whose weights are no longer views of its buffer (the model moved, a weight was replaced) and copies Vᵀ in
again whenever V was written (its version counter) or replaced (its address), as the adapter pack does for V and U.
"""

from __future__ import annotations

from collections import Counter, defaultdict
from typing import NamedTuple, Optional, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

ROW_ALIGN = 8  # the Vᵀ rows padded to a multiple of this: the output keeps 16-byte rows of a half-precision output
# sibling layers that the model families naming them so feed one input: one GEMM in the compiled step
SHARED_INPUT = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
# a layer alone in its buffer takes its expand as a product of its own (module docstring); False: fused everywhere
EXPAND_APART = True


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


def input_groups(names: Sequence[str], grouped: bool = True) -> list[list[int]]:
    """The indices of `names` (the wrapped layers' module paths, in order) in groups that take one input:
    siblings (one parent) named in one `SHARED_INPUT` set; every other layer alone (all alone if not `grouped`)."""
    groups: dict[tuple[str, int], list[int]] = defaultdict(list)
    for index, name in enumerate(names):
        parent, _, leaf = name.rpartition(".")
        kind = next((k for k, leaves in enumerate(SHARED_INPUT) if leaf in leaves), None) if grouped else None
        groups[(parent, kind) if kind is not None else (name, -1)].append(index)
    return sorted(groups.values())


class JointSlot(NamedTuple):
    """Where one layer reads its outputs in its group's product, for one compiled call."""

    buffer: torch.Tensor  # the group's joint buffer
    group: int
    start: int  # the layer's first output column
    rows: int  # N, its output features
    h_start: int  # its x V columns
    bias: Optional[torch.Tensor]  # the layer's own, from the refresh's dict (a compiled call guards only real ones)
    memo: dict  # group -> (input, product) of this call, shared by every slot of the call
    apart: bool = False  # the expand as a product of its own (a layer alone), else fused into its consumer


class JointWeights:
    """The joint buffers of `modules` (each a `BEMLinear`) in `groups` (lists of module indices; default: each
    module alone). A module that cannot take the form, or whose group differs in K, dtype or device, has none."""

    # One buffer a group formed at the last refresh, by group number. Held in dicts (the biases too): dynamo skips
    # the tensor guards of a dict's values while the dict is unchanged, and checks a list's on every call.
    joints: dict[int, torch.Tensor]
    # per module: (group, start, rows, h_start) into `joints`, or None; constants of the compiled call
    layout: tuple[Optional[tuple[int, int, int, int]], ...]
    _members: list[list[int]]  # the modules of each buffer
    _alone: tuple[bool, ...]  # per module: the only module of its buffer
    biases: dict[int, torch.Tensor]  # by module index, of the base layers with one, at the refresh
    _with_bias: tuple[bool, ...]  # per module: whether `biases` holds its own (a constant of the compiled call)
    _seen: list[Optional[tuple[torch.Tensor, int]]]  # per module: the V copied in, and its version

    def __init__(self, modules: Sequence[nn.Module], groups: Optional[Sequence[Sequence[int]]] = None) -> None:
        self._modules = list(modules)
        self._groups = [list(group) for group in groups] if groups is not None else [[i] for i in
                                                                                       range(len(self._modules))]
        self.release()

    def release(self) -> None:
        """Forget every joint buffer (the weights stay views of them until replaced) and the biases with them (a
        model moved frees them)."""
        none = (None,) * len(self._modules)
        self.joints, self.layout, self._members, self.biases = {}, none, [], {}
        self._alone = self._with_bias = (False,) * len(self._modules)
        self._seen = list(none)

    def unjoin(self) -> None:
        """Give each weight still in a joint buffer a storage of its own size back, and forget the buffers."""
        with torch.inference_mode(False), torch.no_grad():
            for index, where in enumerate(self.layout):
                weight = self._weight(index)
                if where is not None and self._in_buffer(weight, where):
                    weight.data = weight.detach().clone()
        self.release()

    def slots(self, memo: dict) -> list[Optional[JointSlot]]:
        """Each module's `JointSlot` (None without a buffer), all sharing `memo`."""
        joints, biases = self.joints, self.biases
        return [None if where is None else JointSlot(joints[where[0]], *where, biases[index] if with_bias else None,
                                                     memo, EXPAND_APART and alone)
                for index, (where, with_bias, alone) in enumerate(zip(self.layout, self._with_bias, self._alone))]

    def _weight(self, index: int) -> Optional[torch.Tensor]:
        return getattr(self._modules[index]._modules.get("base_layer"), "weight", None)

    def _in_buffer(self, weight: Optional[torch.Tensor], where: tuple[int, int, int, int]) -> bool:
        """Whether `weight` is still the view of its rows `where` (a layout entry of the current buffers)."""
        group, start, rows, _ = where
        joint = self.joints[group]
        return (weight is not None and weight.shape == (rows, joint.shape[1]) and weight.dtype == joint.dtype
                and weight.data_ptr() == joint.data_ptr() + start * joint.stride(0) * joint.element_size())

    def _formed_groups(self, weights: list[Optional[torch.Tensor]]) -> list[list[int]]:
        """The configured groups, each cut down to the modules that can join it: joinable, sharing the first one's
        K, dtype and device, with a weight no other wrapped layer shares (it could be the rows of one buffer only).
        `weights`: each module's base weight."""
        owners = Counter(id(weight) for weight in weights if weight is not None)
        formed = []
        for group in self._groups:
            members = [i for i in group if joinable(self._modules[i]) and owners[id(weights[i])] == 1]
            if not members:
                continue
            first = weights[members[0]]
            alike = [i for i in members if weights[i].shape[1] == first.shape[1] and weights[i].dtype == first.dtype
                     and weights[i].device == first.device]
            formed.append(alike)
            formed.extend([i] for i in members if i not in alike)
        return formed

    def refresh(self) -> None:
        """Bring every joint buffer up to date with its weights and Vs."""
        weights = [self._weight(index) for index in range(len(self._modules))]
        groups = self._formed_groups(weights)
        biases = [getattr(module._modules.get("base_layer"), "bias", None) for module in self._modules]
        self.biases = {index: bias for index, bias in enumerate(biases) if bias is not None}
        self._with_bias = tuple(bias is not None for bias in biases)
        # a normal tensor even inside inference mode: the weight is a view of it and autograd may save it later
        with torch.inference_mode(False), torch.no_grad():
            if groups != self._members or not all(
                    self._in_buffer(weights[i], self.layout[i]) for group in groups for i in group):
                self._rehome(groups, weights)
            for index, where in enumerate(self.layout):
                if where is None:
                    continue
                V = self._modules[index]._parameters["bem_V"].detach()
                seen = self._seen[index]
                if seen is None or seen[0].data_ptr() != V.data_ptr() or seen[1] != V._version:
                    group, _, _, h_start = where
                    self.joints[group][h_start:h_start + V.shape[1]].copy_(V.t())
                    self._seen[index] = (V, V._version)

    def _rehome(self, groups: list[list[int]], module_weights: list[Optional[torch.Tensor]]) -> None:
        """New buffers for `groups`: each holds its modules' W, then zeros where the Vᵀ rows go; each weight's data
        becomes its rows (the old storage goes once nothing else holds it: W is never kept twice)."""
        joints, layout = {}, [None] * len(self._modules)
        for number, group in enumerate(groups):
            weights = [module_weights[i] for i in group]
            rows = sum(w.shape[0] for w in weights)
            rank = sum(self._modules[i]._parameters["bem_V"].shape[1] for i in group)
            first = weights[0]
            joint = torch.empty(rows + _padded_rank(rank), first.shape[1], dtype=first.dtype, device=first.device)
            start, h_start = 0, rows
            for index, weight in zip(group, weights):
                N = weight.shape[0]
                joint[start:start + N].copy_(weight.detach())
                layout[index] = (number, start, N, h_start)
                start, h_start = start + N, h_start + self._modules[index]._parameters["bem_V"].shape[1]
            joint[rows:].zero_()
            for index, weight in zip(group, weights):
                _, start, N, _ = layout[index]
                weight.data = joint[start:start + N]
            # a fixed address: CUDA-graph replays read it in place instead of copying it in before each replay
            torch._dynamo.mark_static_address(joint)
            joints[number] = joint
        self.joints, self.layout, self._members = joints, tuple(layout), groups
        alone = {group[0] for group in groups if len(group) == 1}
        self._alone = tuple(index in alone for index in range(len(self._modules)))
        self._seen = [None] * len(self._modules)


def joint_linear(x: torch.Tensor, slot: JointSlot, codes: Optional[torch.Tensor], U: torch.Tensor,
                 scaling: float) -> torch.Tensor:
    """`x Wᵀ + b + s ((x V) ⊙ c) Uᵀ` from the group's product `x [W_1; ...; V_1ᵀ; ...]ᵀ` (computed here, or kept
    by an earlier layer of the group called with this same x), then the expand: a product of inner size r where
    `slot.apart`, else r multiply-adds written out, which the compiler fuses with the consumer.
    x (..., K), codes (..., r) or None, U (N, r)."""
    held = slot.memo.get(slot.group)
    if held is not None and held[0] is x:
        z = held[1]
    else:
        z = F.linear(x, slot.buffer)
        slot.memo[slot.group] = (x, z)
    r = U.shape[1]
    h = z[..., slot.h_start:slot.h_start + r]
    h = h * scaling if codes is None else h * codes * scaling
    out = z[..., slot.start:slot.start + slot.rows]
    if slot.bias is not None:
        out = out + slot.bias
    if slot.apart:
        return out + h @ U.t()
    for j in range(r):
        out = out + h[..., j:j + 1] * U[:, j]
    return out
