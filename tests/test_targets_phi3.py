"""Phi-3's fused projections (gate_up_proj, qkv_proj) are found by the built-in attach points."""

from __future__ import annotations

import torch
from transformers import AutoModelForCausalLM, Phi3Config

from bem import HierarchicalBEMConfig, create_hierarchical_bem


def test_phi3_attach_points_cover_its_fused_projections():
    torch.manual_seed(0)
    config = Phi3Config(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                        num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, bos_token_id=1,
                        eos_token_id=2)
    base = AutoModelForCausalLM.from_config(config).eval()
    ids = torch.randint(3, 64, (1, 7))
    expected = base(input_ids=ids).logits
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4, attach_qkv=True))
    suffixes = sorted({name.rsplit(".", 1)[-1] for name in model.bem_module_names})
    assert suffixes == ["down_proj", "gate_up_proj", "o_proj", "qkv_proj"]
    assert len(model.bem_module_names) == 8
    assert torch.equal(model(input_ids=ids).logits, expected)
