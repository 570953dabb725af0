"""Architectures and sizes for freshly initialised models (`model.architecture` + `model.size`)."""

from __future__ import annotations

from typing import Any

from .schema import ConfigError

# Hugging Face config attributes per (architecture, size); vocab_size grows to fit the tokenizer.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "llama": {
        # initializer_range 0.1: behind the final RMSNorm a frozen lm_head at the usual 0.02 caps the logit
        # range of a fresh model so low that adapters alone cannot make confident predictions
        "tiny": dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                     num_key_value_heads=2, vocab_size=259, max_position_embeddings=1024, initializer_range=0.1),
        "small": dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8,
                      num_key_value_heads=4, vocab_size=32000, max_position_embeddings=2048),
        # the 1B class: Llama-style, 16 blocks of 2048 with a 4x SwiGLU FFN and grouped KV heads
        "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                   num_key_value_heads=8, vocab_size=32000, max_position_embeddings=4096, rope_theta=10000.0),
    },
    "gpt2": {
        "tiny": dict(n_embd=128, n_layer=2, n_head=4, n_positions=1024, vocab_size=259, initializer_range=0.1),
    },
}


def check_preset(architecture: str, size: str) -> None:
    from ..config import closest_name

    if architecture not in PRESETS:
        raise ConfigError("model.architecture", f"unknown architecture '{architecture}'"
                                                f"{closest_name(architecture, PRESETS)}; known: {', '.join(PRESETS)}")
    if size not in PRESETS[architecture]:
        raise ConfigError("model.size", f"unknown size '{size}' for {architecture}"
                                        f"{closest_name(size, PRESETS[architecture])}; "
                                        f"known: {', '.join(PRESETS[architecture])}")


def preset_config(architecture: str, size: str, overrides: dict[str, Any], min_vocab: int = 0):
    """A transformers `PretrainedConfig` for the preset with `overrides` applied."""
    check_preset(architecture, size)
    config_class = _config_class(architecture)
    defaults = config_class()
    for key in overrides:
        # transformers configs accept any attribute silently; a typo here would be ignored
        if not hasattr(defaults, key):
            raise ConfigError(f"model.config_overrides.{key}",
                              f"{config_class.__name__} has no attribute '{key}'")
    values = dict(PRESETS[architecture][size])
    values.update(overrides)
    values["vocab_size"] = max(int(values.get("vocab_size", 0)), min_vocab)
    try:
        return config_class(**values)
    except (TypeError, ValueError) as err:
        raise ConfigError("model.config_overrides", f"not a valid {config_class.__name__}: {err}") from None


def _config_class(architecture: str) -> type:
    from transformers import GPT2Config, LlamaConfig

    return {"llama": LlamaConfig, "gpt2": GPT2Config}[architecture]
