"""What the training benchmarks compare: the variants and the matching PEFT LoRA config."""

from __future__ import annotations

# all seven projections of a Llama block, for BEM and LoRA alike
TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def variant_rows() -> list[tuple[str, dict]]:
    """(row name, HierarchicalBEMConfig overrides); PEFT LoRA has none."""
    return [
        ("BEM (reference path)", {"use_fused_kernels": False}),
        ("BEM (fused kernels)", {"use_fused_kernels": True}),
        ("PEFT LoRA", {}),
    ]


def lora_config(bem_config):
    """PEFT LoRA with BEM's rank, alpha, dropout and targets."""
    from peft import LoraConfig

    return LoraConfig(r=bem_config.rank, lora_alpha=bem_config.alpha, lora_dropout=bem_config.dropout,
                      target_modules=TARGETS, bias="none", task_type="CAUSAL_LM")
