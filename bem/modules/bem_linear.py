"""`BEMLinear`: a frozen linear (or GPT-2 `Conv1D`) plus a code-modulated low-rank update.

    y = base_layer(x) + s * ((dropout(x) V) ⊙ c_t) U^T,   s = alpha / rank

The codes `c_t` for this module are read from a `RoutingContext` shared with the controller;
the update itself goes through `bem.kernels.ops`, the single kernel/reference dispatch point.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Optional, Sequence

import torch
import torch.nn as nn
from transformers.pytorch_utils import Conv1D

from ..kernels import ops
from ..kernels.quant import ops as quant_ops
from .joint_weights import JointSlot, joint_linear

if TYPE_CHECKING:
    from .adapter_pack import AdapterPack


class RoutingContext:
    """Per-model scratch space shared by the controller and every `BEMLinear`.

    `codes` holds the current forward's codes, one (*leading_dims, rank) tensor per module; `None`
    means routing is off (every code is one). `enabled` False makes every wrapped layer its bare base.
    `pack` is the model's `AdapterPack` while `generate` runs, and `weights` each module's (V, U, joint) from it
    during a compiled no-grad call (None otherwise: the modules read their parameters): V and U views of the pack,
    joint the module's [W; Vᵀ] buffer or None.
    """

    def __init__(self) -> None:
        self.enabled: bool = True
        self.codes: Optional[Sequence[torch.Tensor]] = None
        self.pack: Optional["AdapterPack"] = None
        self.weights: Optional[Sequence[tuple[torch.Tensor, torch.Tensor]]] = None

    def __getstate__(self) -> dict:
        # The codes are one forward's scratch, part of its autograd graph, and the pack and its views belong to a
        # running `generate`: a copied or pickled model starts without them (deepcopy refuses tensors that are not
        # graph leaves).
        return {"enabled": self.enabled, "codes": None, "pack": None, "weights": None}

    def set_codes(self, codes: torch.Tensor) -> None:
        """codes: (num_modules, *leading_dims, rank), split once per forward."""
        self.codes = codes.unbind(0)


def linear_features(layer: nn.Module) -> tuple[int, int]:
    """(in_features K, out_features N) of an `nn.Linear` or `Conv1D`."""
    if isinstance(layer, nn.Linear):
        return layer.in_features, layer.out_features
    if isinstance(layer, Conv1D):
        return layer.weight.shape[0], layer.weight.shape[1]
    raise TypeError(f"BEM wraps nn.Linear and transformers Conv1D layers, not {type(layer).__name__}")


ADAPTER_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def adapter_dtype(layer: nn.Module) -> torch.dtype:
    """The dtype of a layer's adapter weights: its weight's, or for a weight stored otherwise (a quantized layer's
    int8, uint8 or float8) the dtype the layer computes in (`compute_dtype`, as bitsandbytes' layers say), else
    float32."""
    dtype = layer.weight.dtype
    if dtype in ADAPTER_DTYPES:
        return dtype
    compute = getattr(layer, "compute_dtype", None)
    return compute if compute in ADAPTER_DTYPES else torch.float32


class BEMLinear(nn.Module):
    """Wraps a frozen `base_layer`; only `bem_V` (K x r) and `bem_U` (N x r) are trainable."""

    def __init__(
        self,
        base_layer: nn.Module,
        rank: int,
        alpha: float,
        dropout: float,
        module_index: int,
        context: RoutingContext,
        use_fused_kernels: bool = True,
        name: str = "",
    ) -> None:
        super().__init__()
        in_features, out_features = linear_features(base_layer)
        self.base_layer = base_layer
        self.in_features, self.out_features = in_features, out_features
        self.rank = rank
        self.name = name
        self.context = context
        self.dropout = nn.Dropout(dropout) if dropout > 0 else nn.Identity()
        weight = base_layer.weight
        # A layer whose forward is its own (a quantized linear that dequantizes, a subclass that computes something
        # else) is called as it is, with the update added; BEM's kernels multiply by the weight only of a layer
        # that is nn.Linear's or Conv1D's own product of a floating-point weight.
        owns_product = (type(base_layer).forward in (nn.Linear.forward, Conv1D.forward)
                        and weight.dtype in ADAPTER_DTYPES)
        # What a call reads of the module, as one tuple of constants (the properties below name its fields): a
        # compiled call guards the tuple, where it guarded each of six attributes (with the helpers as module
        # functions, a 112-linear model's decoding step checks 3,804 guards instead of 4,473), and an eager call
        # reads one attribute instead of six.
        self.spec: tuple[int, float, bool, bool, bool, bool] = (
            module_index, alpha / rank, isinstance(base_layer, Conv1D), owns_product, dropout > 0, use_fused_kernels)
        factory = {"device": weight.device, "dtype": adapter_dtype(base_layer)}
        self.bem_V = nn.Parameter(torch.empty(in_features, rank, **factory))
        self.bem_U = nn.Parameter(torch.zeros(out_features, rank, **factory))
        self.reset_bem_parameters()
        self._v_t = ops.TransposeKeeper()  # V^T for the prefill kernels that read it, at inference

    module_index = property(lambda self: self.spec[0], doc="This module's index into the controller's codes.")
    scaling = property(lambda self: self.spec[1], doc="s = alpha / rank.")
    is_conv1d = property(lambda self: self.spec[2], doc="The base layer is transformers' Conv1D (W stored K x N).")
    owns_product = property(lambda self: self.spec[3],
                            doc="The base layer's output is its floating-point weight's product (the kernels').")
    has_dropout = property(lambda self: self.spec[4], doc="Dropout before the update (training only).")
    use_fused_kernels = property(lambda self: self.spec[5], doc="Whether calls may take BEM's CUDA kernels.")

    def reset_bem_parameters(self) -> None:
        # V^T plays LoRA's A (r x K): Kaiming-uniform as LoRA initialises A; U = 0 keeps the base exact.
        lora_a = torch.empty(self.rank, self.in_features, device=self.bem_V.device, dtype=torch.float32)
        nn.init.kaiming_uniform_(lora_a, a=math.sqrt(5))
        with torch.no_grad():
            self.bem_V.copy_(lora_a.t())
            self.bem_U.zero_()

    def check_mergeable(self) -> None:
        """Raise ValueError, naming this module, if its base weight cannot take the update."""
        weight = self.base_layer.weight
        if not weight.dtype.is_floating_point or weight.device.type == "meta":
            raise ValueError(f"{self.name}: cannot merge into a {weight.dtype} weight on {weight.device}")
        if not self.owns_product:
            raise ValueError(f"{self.name}: cannot merge into a {type(self.base_layer).__name__}, whose forward is its "
                             f"own (its {weight.dtype} weight is not what it multiplies by)")

    def merge_into_base(self) -> None:
        """Add the update with every code one, s U V^T, to the base weight (computed in float32)."""
        self.check_mergeable()
        weight = self.base_layer.weight
        with torch.no_grad():
            delta = self.scaling * (self.bem_U.float() @ self.bem_V.float().t())  # N x K, as nn.Linear
            weight.add_((delta.t() if self.is_conv1d else delta).to(device=weight.device, dtype=weight.dtype))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Hot path: at decode sizes, and for short prompts, generation is bound by host time, and each
        # call's Python cost is what users pay. Parameters and the base layer are read from nn.Module's
        # dicts, which costs a tenth of its attribute lookup (about 1 µs a name), and the helpers are module
        # functions, not methods: a compiled call guards every method it looks up on every module.
        context = self.context
        if not context.enabled:
            return self._modules["base_layer"](x)
        spec = self.spec
        index, scaling, is_conv1d, owns_product, has_dropout, use_fused = spec
        codes = None if context.codes is None else context.codes[index]
        if context.weights is not None:  # compiled, no grad, inside generate: the adapter pack's weights
            return _forward_checked(self, spec, x, codes, context.weights[index])
        params = self._parameters
        V = params["bem_V"]
        # Inference in V's dtype (grad mode, tracing, autocast and device: `_inference_call`) goes straight to
        # the extension, which checks the operands' shapes itself (the general path below compares them in
        # Python, a microsecond a call) and refuses what it does not take as it is: that call then takes the
        # general path.
        if (x.dtype == V.dtype and use_fused and owns_product
                and (codes is None or codes.dtype == V.dtype) and not (has_dropout and self.training)
                and ops._inference_call(x, V)):
            weight, bias = _base_weight_and_bias(self)
            y = ops.direct_linear(x, weight.t() if is_conv1d else weight, bias, V, codes, params["bem_U"],
                                  scaling, self._v_t)
            if y is not None:
                return y
        return _forward_checked(self, spec, x, codes)

    def _forward_autocast(self, x: torch.Tensor, codes: Optional[torch.Tensor]) -> torch.Tensor:
        """Under autocast the update runs in the autocast dtype, as `F.linear` does: only the small
        V, U and codes are cast (e.g. fp32 adapter weights on a bf16 base), never W, and x only from float32, as
        autocast's linear casts it."""
        dtype = torch.get_autocast_dtype(x.device.type)
        weight = self.base_layer.weight
        spec = self.spec  # read as one tuple, not through the properties (a training step's hot path)
        _, _, _, owns_product, has_dropout, _ = spec
        plain = owns_product and not (has_dropout and self.training)
        # a float32 input (GPT-2's LayerNorm returns one under autocast) is what autocast's own linear would
        # multiply in the autocast dtype: the fused call takes it cast, and returns what that returns
        if plain and weight.dtype == dtype and x.dtype in (dtype, torch.float32):
            x = x.to(dtype)
            codes = None if codes is None else codes.to(dtype)
            V = self.bem_V
            V_cast = V.to(dtype)
            with torch.autocast(x.device.type, enabled=False):
                return _fused(self, spec, x, V_cast, codes, self.bem_U.to(dtype), own_v=V_cast is V)
        return self._forward_base_plus_update(x, codes, dtype)

    def _forward_base_plus_update(self, x: torch.Tensor, codes: Optional[torch.Tensor],
                                  dtype: torch.dtype) -> torch.Tensor:
        """The frozen layer as configured plus the update of dropout(x) computed in `dtype` (PEFT
        computes LoRA in the adapter's dtype the same way)."""
        x_adapter = self.dropout(x.to(dtype))
        codes = None if codes is None else codes.to(dtype)
        _, scaling, _, _, _, use_fused = self.spec
        update = ops.generated_update(x_adapter, self.bem_V.to(dtype), codes, self.bem_U.to(dtype), scaling,
                                      use_fused)
        return self.base_layer(x) + update.to(x.dtype)

    def _reshape_codes(self, codes: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        leading = x.shape[:-1]
        if codes.shape[:-1].numel() == leading.numel():
            return codes.reshape(*leading, self.rank)
        raise ValueError(
            f"BEM module '{self.name}' got an input of shape {tuple(x.shape)} but the controller produced "
            f"codes for {tuple(codes.shape[:-1])} token positions; the model must feed this layer the "
            f"tokens that entered the first block"
        )

    def extra_repr(self) -> str:
        return f"in={self.in_features}, out={self.out_features}, rank={self.rank}, scaling={self.scaling:g}"


def _forward_checked(module: BEMLinear, spec: tuple, x: torch.Tensor, codes: Optional[torch.Tensor],
                     packed: Optional[tuple[torch.Tensor, torch.Tensor, Optional[JointSlot]]] = None
                     ) -> torch.Tensor:
    """Every other call: codes laid out as x, autocast, casts, dropout, layers with their own forward.
    `packed`: the module's (V, U, joint) read from the adapter pack, equal to its parameters (joint: where its
    outputs lie in its group's [W; Vᵀ] product, or None)."""
    if codes is not None and codes.shape[:-1] != x.shape[:-1]:
        codes = module._reshape_codes(codes, x)
    if torch.is_autocast_enabled("cuda") if x.is_cuda else torch.is_autocast_enabled(x.device.type):
        return module._forward_autocast(x, codes)
    _, scaling, _, owns_product, has_dropout, use_fused = spec
    if packed is None:
        params = module._parameters
        V, U, joint = params["bem_V"], params["bem_U"], None
    else:  # the module's own dicts stay unread: a compiled call guards what it reads of each module
        V, U, joint = packed
    if not owns_product and use_fused and not (has_dropout and module.training):
        # a 4-bit bitsandbytes layer: BEM's 4-bit path (bem/kernels/quant/ops.py), or None where it declines
        y = quant_ops.fused_linear(module._modules["base_layer"], x, V, codes, U, scaling)
        if y is not None:
            return y
    if x.dtype != V.dtype or (has_dropout and module.training) or not owns_product:
        return module._forward_base_plus_update(x, codes, V.dtype)
    if codes is not None and codes.dtype != V.dtype:
        codes = codes.to(V.dtype)
    if joint is not None:  # generate's compiled step: the base's GEMM computes x V too (joint_weights)
        return joint_linear(x, joint, codes, U, scaling)
    return _fused(module, spec, x, V, codes, U, own_v=packed is None)


def _fused(module: BEMLinear, spec: tuple, x: torch.Tensor, V: torch.Tensor, codes: Optional[torch.Tensor],
           U: torch.Tensor, own_v: bool) -> torch.Tensor:
    """own_v: V is the module's parameter (not a cast copy, not the adapter pack's view), whose transpose the
    module keeps for the prefill kernels."""
    _, scaling, is_conv1d, _, _, use_fused = spec
    weight, bias = _base_weight_and_bias(module)
    return ops.bem_linear(x, weight.t() if is_conv1d else weight, bias, V, codes, U, scaling, use_fused,
                          v_t=module._v_t if own_v else None)


def _base_weight_and_bias(module: BEMLinear) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
    base = module._modules["base_layer"]
    found = base._parameters
    # a weight or bias that is not a registered parameter (a buffer, a property) is read by attribute
    weight = found.get("weight")
    if weight is None:
        weight = base.weight
    bias = found["bias"] if "bias" in found else getattr(base, "bias", None)
    return weight, bias
