"""Routing off, BEM is LoRA: same outputs as PEFT, and adapters move both ways."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem

from conftest import random_ids

TARGETS = {
    "llama": ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"],
    "gpt2": ["c_attn", "c_proj", "c_fc"],
    "bert": ["query", "key", "value", "dense"],
}


def peft_lora(base, arch: str, rank: int = 4, alpha: float = 8.0):
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=TARGETS[arch], lora_dropout=0.0,
                        fan_in_fan_out=arch == "gpt2", init_lora_weights=False)  # random A and B
    return get_peft_model(base, config).eval()


def lora_weights(peft_model) -> dict[str, tuple[torch.Tensor, torch.Tensor]]:
    """module name (relative to the HF model) -> (A, B)."""
    weights = {}
    for name, module in peft_model.base_model.model.named_modules():
        if hasattr(module, "lora_A") and "default" in module.lora_A:
            weights[name] = (module.lora_A["default"].weight.detach(), module.lora_B["default"].weight.detach())
    return weights


def routing_off_bem(base, seed: int, rank: int = 4, alpha: float = 8.0):
    """A routing-off BEM whose update is not zero (U random)."""
    bem = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=rank, alpha=alpha, enable_routing=False))
    torch.manual_seed(seed)
    with torch.no_grad():
        for _, module in bem.bem_modules():
            module.bem_U.normal_(std=0.3)
    return bem


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_routing_off_with_lora_weights_equals_peft_lora(arch, load_base):
    torch.manual_seed(0)
    lora = peft_lora(load_base(arch), arch)
    ids = random_ids(2, 12)
    expected = lora(input_ids=ids).logits
    weights = lora_weights(lora)
    bem = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(
        rank=4, alpha=8.0, enable_routing=False, target_modules=sorted(weights)))
    assert sorted(bem.bem_module_names) == sorted(weights)
    with torch.no_grad():
        for name, module in bem.bem_modules():
            module.bem_V.copy_(weights[name][0].t())
            module.bem_U.copy_(weights[name][1])
    got = bem(input_ids=ids).logits
    assert (got - expected).abs().max().item() < 1e-5
    assert (expected - load_base(arch)(input_ids=ids).logits).abs().max().item() > 1e-3  # the update matters


@pytest.mark.parametrize("enable_routing", [False, True])
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_bem_from_saved_peft_lora_gives_its_outputs(arch, enable_routing, load_base, tmp_path):
    torch.manual_seed(1)
    lora = peft_lora(load_base(arch), arch)
    lora.save_pretrained(tmp_path)
    ids = random_ids(2, 10, seed=1)
    expected = lora(input_ids=ids).logits
    bem = BEMModel.from_peft_lora(load_base(arch), tmp_path, enable_routing=enable_routing)
    assert (bem.controller is not None) == enable_routing
    assert (bem(input_ids=ids).logits - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_export_routing_off_bem_loads_in_peft(arch, load_base, tmp_path):
    bem = routing_off_bem(load_base(arch), seed=2)
    ids = random_ids(2, 10, seed=2)
    expected = bem(input_ids=ids).logits
    bem.save_as_peft_lora(tmp_path)
    loaded = PeftModel.from_pretrained(load_base(arch), tmp_path).eval()
    assert (loaded(input_ids=ids).logits - expected).abs().max().item() < 1e-5


def test_export_refuses_a_routed_bem(load_base, tmp_path):
    bem = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    with pytest.raises(ValueError, match="enable_routing=False"):
        bem.save_as_peft_lora(tmp_path)


def test_from_peft_lora_rejects_what_it_cannot_represent(load_base, tmp_path):
    lora = get_peft_model(load_base("llama"), LoraConfig(r=4, target_modules=["q_proj"], use_dora=True))
    lora.save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="use_dora"):
        BEMModel.from_peft_lora(load_base("llama"), tmp_path)
    with pytest.raises(FileNotFoundError, match="adapter_config.json"):
        BEMModel.from_peft_lora(load_base("llama"), tmp_path / "nowhere")


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_merge_and_unload_folds_the_update_into_the_weights(arch, load_base):
    bem = routing_off_bem(load_base(arch), seed=3)
    ids = random_ids(2, 10, seed=3)
    expected = bem(input_ids=ids).logits
    merged = bem.merge_and_unload()
    assert not any(type(m).__name__ == "BEMLinear" for m in merged.modules())
    assert (merged(input_ids=ids).logits - expected).abs().max().item() < 1e-4
    assert (expected - load_base(arch)(input_ids=ids).logits).abs().max().item() > 1e-3  # the update matters


def test_merge_and_unload_matches_peft_merge(load_base, tmp_path):
    """The BEM exported as LoRA and merged by PEFT gives the same weights as BEM's own merge."""
    bem = routing_off_bem(load_base("gpt2"), seed=4)
    bem.save_as_peft_lora(tmp_path)
    ours = bem.merge_and_unload().state_dict()
    theirs = PeftModel.from_pretrained(load_base("gpt2"), tmp_path).merge_and_unload().state_dict()
    assert sorted(ours) == sorted(theirs)
    for key, value in ours.items():
        assert torch.allclose(value, theirs[key], atol=1e-6), key


def test_merge_and_unload_refuses_a_routed_bem(load_base):
    bem = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    with pytest.raises(ValueError, match="enable_routing=False can be merged"):
        bem.merge_and_unload()
    assert any(type(m).__name__ == "BEMLinear" for m in bem.base_model.modules())  # left as it was


def test_merge_and_unload_refuses_an_integer_weight_before_changing_any(load_base):
    bem = routing_off_bem(load_base("llama"), seed=5, alpha=16.0)
    names = [name for name, _ in bem.bem_modules()]
    last = bem.base_model.get_submodule(names[-1]).base_layer
    last.weight = torch.nn.Parameter(last.weight.to(torch.int8), requires_grad=False)
    first = bem.base_model.get_submodule(names[0]).base_layer.weight.clone()
    with pytest.raises(ValueError, match=f"{names[-1]}: cannot merge into a torch.int8 weight"):
        bem.merge_and_unload()
    assert torch.equal(bem.base_model.get_submodule(names[0]).base_layer.weight, first)


def test_peft_names_disable_adapter_and_get_base_model(load_base):
    bem = routing_off_bem(load_base("llama"), seed=6)
    ids = random_ids(2, 8, seed=6)
    base_logits = load_base("llama")(input_ids=ids).logits
    assert bem.get_base_model() is bem.base_model
    with bem.disable_adapter():
        assert torch.equal(bem(input_ids=ids).logits, base_logits)
    assert not torch.allclose(bem(input_ids=ids).logits, base_logits)


@pytest.mark.parametrize("arch", ["llama", "gpt2", "bert"])
def test_all_linear_wraps_what_peft_wraps(arch, load_base):
    lora = get_peft_model(load_base(arch), LoraConfig(r=4, target_modules="all-linear", fan_in_fan_out=arch == "gpt2"))
    expected = sorted(lora_weights(lora))
    bem = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(rank=4, target_modules="all-linear",
                                                                         token_routing_modules="all-linear"))
    assert sorted(bem.bem_module_names) == expected
    assert sorted(bem.token_routed_names) == expected
    assert not any("lm_head" in name or "decoder" in name for name in expected)
