"""A base linear whose forward is its own (a quantized layer that dequantizes, a subclass that changes what it
computes) is called as it is, with the update added in a floating adapter dtype: never bypassed by BEM's own
product of its weight."""

from __future__ import annotations

import pytest
import torch
import torch.nn as nn

from bem import HierarchicalBEMConfig, create_hierarchical_bem

from conftest import random_ids, randomize_bem


class Int8Linear(nn.Linear):
    """A stand-in for a quantized linear (bitsandbytes' Linear8bitLt, say): an int8 weight and a scale per
    output, dequantized in its own forward."""

    def __init__(self, linear: nn.Linear) -> None:
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None)
        scale = linear.weight.detach().abs().amax(1, keepdim=True).clamp_min(1e-8) / 127
        self.weight = nn.Parameter((linear.weight.detach() / scale).round().to(torch.int8), requires_grad=False)
        self.register_buffer("scale", scale)
        if linear.bias is not None:
            self.bias = nn.Parameter(linear.bias.detach().clone(), requires_grad=False)
        self.compute_dtype = torch.float32

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return nn.functional.linear(x, self.weight.float() * self.scale, self.bias)


class ShiftedLinear(nn.Linear):
    """A floating-point subclass whose forward adds something of its own."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return super().forward(x) + 0.5


def swap_linears(model: nn.Module, make) -> None:
    for name, module in list(model.named_modules()):
        for child_name, child in list(module.named_children()):
            if type(child) is nn.Linear and child_name != "lm_head":
                setattr(module, child_name, make(child))


def shifted(linear: nn.Linear) -> ShiftedLinear:
    layer = ShiftedLinear(linear.in_features, linear.out_features, bias=linear.bias is not None)
    layer.load_state_dict(linear.state_dict())
    return layer


@pytest.mark.parametrize("make", [Int8Linear, shifted], ids=["int8", "shifted"])
def test_a_base_layer_with_its_own_forward_is_called_as_it_is(make, load_base):
    base = load_base("llama")
    swap_linears(base, make)
    ids = random_ids(2, 9)
    expected = base(input_ids=ids).logits
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, chunk_size=3, attach_qkv=True))
    layer = dict(model.bem_modules())["model.layers.0.mlp.up_proj"]
    assert layer.bem_V.dtype == torch.float32 and layer.bem_V.requires_grad
    assert torch.allclose(model(input_ids=ids).logits, expected, atol=1e-6)  # U = 0: the base exactly
    randomize_bem(model, seed=3)
    x = torch.randn(2, 5, layer.in_features)
    with torch.no_grad():
        model.context.codes = None  # routing off for this direct call: every code one
        want = layer.base_layer(x) + layer.scaling * (x @ layer.bem_V) @ layer.bem_U.t()
        assert torch.allclose(layer(x), want, atol=1e-5)
    out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert layer.bem_U.grad is not None and layer.bem_U.grad.abs().sum() > 0


@pytest.mark.parametrize("make, message", [
    (Int8Linear, "cannot merge into a torch.int8 weight"),
    (shifted, "cannot merge into a ShiftedLinear, whose forward is its own"),
], ids=["int8", "shifted"])
def test_a_base_layer_with_its_own_forward_cannot_be_merged(make, message, load_base):
    base = load_base("llama")
    swap_linears(base, make)
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, enable_routing=False))
    with pytest.raises(ValueError, match=message):
        model.merge_and_unload()
