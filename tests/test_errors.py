"""Bad input gets an error that names the problem."""

from __future__ import annotations

import pytest
import torch

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from bem.kernels import ops
from bem.call_inputs import CACHE_KEYWORD, returned_cache

from conftest import random_ids


def test_zero_matched_modules_is_an_error(load_base):
    with pytest.raises(ValueError, match="no module matched the BEM targets.*linear layers it has include"):
        create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(target_modules=["not_a_layer"]))
    with pytest.raises(ValueError, match="no module matched"):
        create_hierarchical_bem(load_base("gpt2"), HierarchicalBEMConfig(target_modules=r".*\.q_proj"))


def test_unknown_architecture_needs_target_modules():
    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.blocks = torch.nn.ModuleList([torch.nn.Linear(4, 4)])

    with pytest.raises(ValueError, match="no built-in attach points .* set target_modules"):
        create_hierarchical_bem(Tiny(), HierarchicalBEMConfig())


def test_targets_that_are_not_linears_are_rejected(load_base):
    with pytest.raises(ValueError, match=r"cannot wrap .*self_attn \(LlamaAttention\)"):
        create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(target_modules=["self_attn"]))


def test_wrapping_twice_is_rejected(load_base):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=2))
    with pytest.raises(ValueError, match="already wrapped"):
        create_hierarchical_bem(model, HierarchicalBEMConfig(rank=2))
    with pytest.raises(ValueError, match="already contains BEM modules"):
        create_hierarchical_bem(model.base_model, HierarchicalBEMConfig(rank=2))
    with pytest.raises(TypeError, match="HierarchicalBEMConfig"):
        create_hierarchical_bem(torch.nn.Linear(2, 2), {"rank": 2})


def test_a_model_holding_peft_adapters_is_refused(load_base):
    from peft import LoraConfig, get_peft_model

    lora = get_peft_model(load_base("llama"), LoraConfig(r=2, target_modules=["q_proj", "up_proj"]))
    with pytest.raises(ValueError, match=r"this model holds PEFT modules \(.*Linear.*\); wrap the base model"):
        create_hierarchical_bem(lora, HierarchicalBEMConfig(rank=2))
    with pytest.raises(ValueError, match="holds PEFT modules"):
        create_hierarchical_bem(lora.get_base_model(), HierarchicalBEMConfig(rank=2))  # its layers are still PEFT's


def test_wrong_input_shapes_are_named(load_base):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=2))
    with pytest.raises(ValueError, match=r"input_ids must have shape \(batch, sequence\), got \(7,\)"):
        model(input_ids=random_ids(1, 7)[0])
    with pytest.raises(ValueError, match=r"attention_mask of shape \(1, 3\) does not cover input of shape \(1, 7\)"):
        model(input_ids=random_ids(1, 7), attention_mask=torch.ones(1, 3, dtype=torch.long))
    with pytest.raises(ValueError, match="2-D attention_mask"):
        model(input_ids=random_ids(1, 7), attention_mask=torch.ones(1, 1, 7, 7))


def test_continuing_a_cache_bem_did_not_build_is_refused(load_base):
    base = load_base("llama")
    ids = random_ids(1, 6)
    cache = returned_cache(base(input_ids=ids, use_cache=True))
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=2))
    with pytest.raises(ValueError, match="carries no BEM state"):
        model(input_ids=ids[:, :1], **{CACHE_KEYWORD: cache}, use_cache=True)


def test_op_shape_mismatches_are_named():
    x, V, U = torch.randn(2, 3, 8), torch.randn(8, 4), torch.randn(5, 4)
    with pytest.raises(ValueError, match="input has 7 features in its last dimension, V expects K=8"):
        ops.generated_update(torch.randn(2, 7), V, None, U, 1.0)
    with pytest.raises(ValueError, match=r"rank mismatch: V is \(8, 4\) .* U is \(5, 3\)"):
        ops.generated_update(x, V, None, torch.randn(5, 3), 1.0)
    with pytest.raises(ValueError, match=r"codes must have shape \(2, 3, 4\)"):
        ops.generated_update(x, V, torch.randn(2, 3, 5), U, 1.0)
    with pytest.raises(ValueError, match=r"weight must be \(N, K\) = \(5, 8\)"):
        ops.bem_linear(x, torch.randn(8, 5), None, V, None, U, 1.0)


def test_loading_problems_are_named(load_base, tmp_path, pretrained_dirs):
    with pytest.raises(FileNotFoundError, match="adapter_config.json is missing"):
        BEMModel.from_pretrained(load_base("llama"), tmp_path)
    with pytest.raises(FileNotFoundError, match="this folder holds a model, with its config.json"):
        BEMModel.from_pretrained(load_base("llama"), pretrained_dirs["llama"])  # the base, not an adapter
    (tmp_path / "adapter_config.json").write_text("{not json")
    with pytest.raises(ValueError, match="is not valid JSON"):
        BEMModel.from_pretrained(load_base("llama"), tmp_path)
    (tmp_path / "adapter_config.json").write_text('{"peft_type": "LORA"}')
    with pytest.raises(ValueError, match="not a BEM adapter config"):
        BEMModel.from_pretrained(load_base("llama"), tmp_path)


def test_a_failed_save_keeps_the_previous_adapter(load_base, tmp_path, monkeypatch):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=2))
    model.save_pretrained(tmp_path)
    before = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    import safetensors.torch

    def broken_save(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(safetensors.torch, "save_file", broken_save)
    with torch.no_grad():
        model.bem_modules()[0][1].bem_U.fill_(1.0)
    with pytest.raises(OSError, match="disk full"):
        model.save_pretrained(tmp_path)
    assert {p.name: p.read_bytes() for p in tmp_path.iterdir()} == before  # no torn or temp files
