"""Base model and tokenizer from the `model` section: a local pretrained model or a fresh preset."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Union

import torch
import torch.nn as nn

from ..quantization import load_quantized
from .presets import preset_config
from .schema import ModelSection

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_tokenizer(section: ModelSection, saved_base: Optional[Path] = None):
    """The configured tokenizer; for fresh models the byte-level one (or the copy saved with the run)."""
    from transformers import AutoTokenizer

    source = section.tokenizer or section.path or (str(saved_base) if saved_base and saved_base.is_dir() else None)
    if source is None:
        from .tokenizer import byte_level_tokenizer

        tokenizer = byte_level_tokenizer()
    else:
        tokenizer = AutoTokenizer.from_pretrained(source)
    if tokenizer.pad_token_id is None:
        # causal LMs often ship without one; padding is masked out of attention and loss anyway
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def build_base_model(section: ModelSection, vocab_size: int, saved_base: Optional[Path] = None,
                     device: Union[str, torch.device, None] = None) -> nn.Module:
    """Load `section.path`, else the run's saved fresh model, else initialise the preset at random. With
    `section.quantization` a model loaded from a directory is quantized as it loads; a fresh one is returned in
    full precision (the trainer saves it, then loads it back from there, quantized)."""
    from transformers import AutoModelForCausalLM

    dtype = DTYPES[section.dtype]
    attention = {"attn_implementation": section.attn_implementation} if section.attn_implementation else {}
    kwargs = {"dtype": dtype, **attention}
    path = section.path or (str(saved_base) if saved_base is not None and (saved_base / "config.json").is_file() else None)
    if path is not None and section.quantization is not None:
        return load_quantized(path, section.quantization, torch.device(device or "cpu"), dtype, **attention)
    if path is not None:
        model = AutoModelForCausalLM.from_pretrained(path, **kwargs)
        return model.to(device) if device is not None else model
    config = preset_config(section.architecture, section.size, section.config_overrides, min_vocab=vocab_size)
    with torch.device(device or "cpu"):
        return AutoModelForCausalLM.from_config(config, **kwargs)


def enable_gradient_checkpointing(model: nn.Module) -> None:
    """Recompute the frozen base's activations in backward. Non-reentrant: the base's inputs do not
    require grad, only BEM's weights do, and reentrant checkpointing would drop their gradients."""
    options = {"use_reentrant": False}
    # transformers 5 renamed the method and its argument; older releases only have the first name
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=options)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=options)
    model.config.use_cache = False
