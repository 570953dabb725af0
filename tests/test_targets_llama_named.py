"""Models named as Llama is get its built-in attach points, and cached generation equals the full forward on
each; an attach point that finds nothing (Mixtral's fused experts) is refused, not silently skipped."""

from __future__ import annotations

import pytest
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.targets import _LLAMA_NAMED

from conftest import randomize_bem

SHAPE = dict(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8, pad_token_id=0, bos_token_id=1, eos_token_id=2)


def tiny(model_type: str, **extra) -> torch.nn.Module:
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **SHAPE, **extra)).eval()


@pytest.mark.parametrize("model_type", [name for name in _LLAMA_NAMED if name != "mixtral"])
def test_llama_named_models_get_every_attach_point_and_decode_exactly(model_type):
    base = tiny(model_type)
    linears = [name for name, module in base.named_modules() if isinstance(module, torch.nn.Linear)]
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, chunk_size=3, max_prefix_tokens=5,
                                                                controller_dim=16, attach_qkv=True))
    assert sorted(model.bem_module_names) == sorted(name for name in linears if name != "lm_head")  # every block linear
    assert {name.rsplit(".", 1)[-1] for name in model.bem_module_names} >= {"up_proj", "down_proj", "q_proj", "o_proj"}
    randomize_bem(model, seed=1, scale=0.1)
    ids = torch.randint(3, 90, (2, 5), generator=torch.Generator().manual_seed(2))
    out = model.generate(ids, max_new_tokens=5, do_sample=False, pad_token_id=0, return_dict_in_generate=True,
                         output_logits=True)
    full = model(input_ids=out.sequences[:, :-1]).logits[:, 4:]
    with model.disable_bem():
        assert (model(input_ids=out.sequences[:, :-1]).logits[:, 4:] - full).abs().max().item() > 1e-2  # BEM acts
    # float32 (transformers computes the rotary angles in float32 even for a float64 model)
    assert (torch.stack(out.logits, 1) - full).abs().max().item() < 1e-5


def test_mixtral_wraps_its_attention_and_refuses_an_mlp_it_cannot_reach():
    base = tiny("mixtral", num_local_experts=2, num_experts_per_tok=1)
    with pytest.raises(ValueError, match="attach_mlp is on, but this mixtral model has no mlp linear"):
        create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4))
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, attach_mlp=False, attach_qkv=True))
    assert sorted({name.rsplit(".", 1)[-1] for name in model.bem_module_names}) == ["k_proj", "o_proj", "q_proj",
                                                                                    "v_proj"]
