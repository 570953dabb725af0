"""The model the breakdown scripts measure: Llama-3.2-1B shapes with random weights, bf16, eager
attention, BEM at rank 8 on all seven projections."""

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem


def llama_1b_with_bem(device: str = "cuda") -> BEMModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, pad_token_id=0)
    base = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    base.config._attn_implementation = "eager"
    return create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, attach_qkv=True))
