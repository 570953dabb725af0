"""The shape families' profile configs: their shapes, their settings, and (shrunk to a few layers of a
few channels) that BEM and the PEFT LoRA peer wrap the same projections of each model."""

from __future__ import annotations

import warnings
from pathlib import Path

import pytest
import torch

from bem.profiling.config import KINDS, load_profile_config
from bem.profiling.models import build_variants, load_base_model
from bem.profiling.sweep import SWEEP, config_path

REPO = Path(__file__).resolve().parents[1]
CONFIGS = REPO / "configs"

# name -> (model_type, the shapes that make the family, wrapped projections per layer)
FAMILIES = {
    "smollm_135m": ("llama", {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30,
                              "num_attention_heads": 9, "num_key_value_heads": 3}, 7),
    "gpt2": ("gpt2", {"n_embd": 768, "n_inner": 3072, "n_layer": 12, "n_head": 12}, 4),
    "qwen2_1.5b": ("qwen2", {"hidden_size": 1536, "intermediate_size": 8960, "num_hidden_layers": 28,
                             "num_attention_heads": 12, "num_key_value_heads": 2}, 7),
    "llama_1b": ("llama", {"hidden_size": 2048, "intermediate_size": 8192, "num_hidden_layers": 16,
                           "num_attention_heads": 32, "num_key_value_heads": 8}, 7),
    "phi3_mini": ("phi3", {"hidden_size": 3072, "intermediate_size": 8192, "num_hidden_layers": 32}, 4),
    "llama3_8b": ("llama", {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
                            "num_attention_heads": 32, "num_key_value_heads": 8}, 7),
}


def test_the_sweep_is_every_family_and_each_name_finds_its_file():
    assert set(SWEEP) == set(FAMILIES)
    for name in SWEEP:
        assert config_path(name) == Path("configs") / f"profile_{name}.yaml" or \
            config_path(name) == CONFIGS / f"profile_{name}.yaml"


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_config_shapes_and_settings(name):
    config = load_profile_config(CONFIGS / f"profile_{name}.yaml")
    model_type, shapes, _ = FAMILIES[name]
    hf = config.model.config
    assert config.name == name and hf["model_type"] == model_type
    assert {key: hf[key] for key in shapes} == shapes
    assert (config.device, config.model.dtype, config.model.attn_implementation) == ("cuda", "bfloat16", "sdpa")
    # the settings of the 1B profile: prefill 1 x 1024 and a larger batch, decode b1 / b16 eager and compiled,
    # a training step; every kind gated
    assert [1, 1024] in config.prefill.shapes and any(b > 1 for b, _ in config.prefill.shapes)
    assert config.decode.batch_sizes == [1, 16] and config.decode.compiled and config.decode.eager
    assert config.train.enabled and set(config.gate) == set(KINDS)
    bem = config.bem_config()
    assert bem.rank == 8 and config.lora and config.max_overhead == 0.15
    # sized for minutes: at most max_seconds of timed repeats per setting, a bounded interval possible
    settings = len(config.prefill.shapes) + 2 * len(config.decode.batch_sizes) + 1
    assert settings * config.timing.max_seconds <= 180
    assert config.timing.min_repeats >= 5 and config.timing.confidence == 0.9
    positions = hf.get("max_position_embeddings") or hf.get("n_positions")
    assert max(length for _, length in config.prefill.shapes) <= positions
    assert config.decode.prompt_length + config.decode.new_tokens <= positions


def _shrunk(hf: dict) -> dict:
    """The same model type and structure (grouped KV, biases, tying, sliding window) at a few channels."""
    small = dict(hf, vocab_size=256)
    if hf["model_type"] == "gpt2":
        return dict(small, n_embd=32, n_inner=64, n_layer=2, n_head=4, n_positions=128)
    grouped = hf.get("num_key_value_heads", hf["num_attention_heads"]) < hf["num_attention_heads"]
    small.update(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2 if grouped else 4, max_position_embeddings=128)
    if "head_dim" in hf:
        small["head_dim"] = 16
    if hf.get("sliding_window"):
        small["sliding_window"] = 8
    return small


@pytest.mark.parametrize("name", list(FAMILIES))
def test_bem_and_lora_wrap_the_same_projections(name):
    config = load_profile_config(CONFIGS / f"profile_{name}.yaml")
    spec = config.model
    spec.config, spec.dtype = _shrunk(spec.config), "float32"
    base = load_base_model(spec, torch.device("cpu"), seed=0)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        variants = build_variants(base, config.bem_config(), with_lora=True)
    names = list(variants.bem.bem_module_names)
    assert len(names) == 2 * FAMILIES[name][2]  # every projection of both layers
    lora_wrapped = {n.removeprefix("base_model.model.").rsplit(".base_layer", 1)[0]
                    for n, _ in variants.lora.named_modules() if n.endswith(".base_layer")}
    assert lora_wrapped == set(names)
    ids = torch.randint(3, 256, (2, 12))
    with torch.no_grad():
        for model in variants.named().values():
            assert torch.isfinite(model(input_ids=ids).logits).all()
