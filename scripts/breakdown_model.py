"""The models the breakdown scripts measure, random weights, bf16, eager attention: Llama-3.2-1B shapes
with BEM at rank 8 on all seven projections, or GPT-2 small's with BEM at rank 8 on its four Conv1D
projections."""

import torch
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem


def llama_1b_with_bem(device: str = "cuda") -> BEMModel:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
                         num_attention_heads=32, num_key_value_heads=8, head_dim=64, pad_token_id=0)
    base = LlamaForCausalLM(config).to(device, torch.bfloat16).eval()
    base.config._attn_implementation = "eager"
    return create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, attach_qkv=True))


def gpt2_small_with_bem(device: str = "cuda") -> BEMModel:
    torch.manual_seed(0)
    config = GPT2Config(vocab_size=50257, n_positions=1024, n_embd=768, n_layer=12, n_head=12, n_inner=3072)
    base = GPT2LMHeadModel(config).to(device, torch.bfloat16).eval()
    base.config._attn_implementation = "eager"
    return create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, attach_qkv=True))


MODELS = {"llama-1b": llama_1b_with_bem, "gpt2": gpt2_small_with_bem}
