"""The three models compared: the frozen base, the BEM-wrapped model and the PEFT LoRA peer.

They are separate copies holding the same base weights, so the base is timed as it really runs (no
wrapper in the way) and BEM and LoRA wrap the same linears at the same rank.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch
import torch.nn as nn

from .. import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from ..quantization import load_quantized, quantized_copy
from .config import ModelSpec, ProfileConfigError

DTYPE_BY_NAME = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


@dataclass
class Variants:
    base: nn.Module
    bem: BEMModel
    lora: Optional[nn.Module]
    lora_note: Optional[str]  # why LoRA is absent, when it is

    def named(self) -> dict[str, nn.Module]:
        models = {"base": self.base, "bem": self.bem}
        if self.lora is not None:
            models["lora"] = self.lora
        return models


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise ProfileConfigError("device is 'cuda' but no CUDA GPU is available to this torch build")
    return torch.device(name)


def load_base_model(spec: ModelSpec, device: torch.device, seed: int) -> nn.Module:
    """A causal LM from a local directory, or built from `spec.config` with seeded random weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    dtype = DTYPE_BY_NAME[spec.dtype]
    if spec.path is not None:
        path = Path(spec.path).expanduser()
        if not path.is_dir():
            raise ProfileConfigError(f"model.path is not a directory: {path}")
        try:
            if spec.quantization is not None:
                return load_quantized(str(path), spec.quantization, device, dtype,
                                      attn_implementation=spec.attn_implementation, local_files_only=True).eval()
            model = AutoModelForCausalLM.from_pretrained(
                path, dtype=dtype, attn_implementation=spec.attn_implementation, local_files_only=True)
        except (OSError, ValueError) as err:
            raise ProfileConfigError(f"could not load a causal LM from {path}: {err}") from None
        model.to(device)
    else:
        fields = dict(spec.config)
        model_type = fields.pop("model_type")
        try:
            hf_config = AutoConfig.for_model(model_type, **fields)
        except (ValueError, KeyError, TypeError) as err:
            raise ProfileConfigError(f"model.config is not a valid '{model_type}' config: {err}") from None
        torch.manual_seed(seed)
        with torch.device(device):  # initialise on the target device: fast for large models
            model = AutoModelForCausalLM.from_config(
                hf_config, dtype=dtype, attn_implementation=spec.attn_implementation)
        if spec.quantization is not None:  # the random weights quantized as a pretrained model's would be
            model = quantized_copy(model, spec.quantization, device, attn_implementation=spec.attn_implementation)
    return model.eval()


def build_variants(base: nn.Module, bem_config: HierarchicalBEMConfig, with_lora: bool) -> Variants:
    """Copies of `base` wrapped with BEM and (when asked and `peft` is importable) LoRA, same targets."""
    bem = create_hierarchical_bem(copy.deepcopy(base), bem_config).eval()
    lora, note = None, None
    if not with_lora:
        note = "disabled in the config"
    else:
        try:
            lora = _lora_peer(base, bem, bem_config)
        except ImportError:
            note = "peft is not installed"
    return Variants(base=base, bem=bem, lora=lora, lora_note=note)


def _lora_peer(base: nn.Module, bem: BEMModel, bem_config: HierarchicalBEMConfig) -> nn.Module:
    return lora_on(copy.deepcopy(base), list(bem.bem_module_names), bem_config).eval()


def lora_on(base: nn.Module, names: list[str], bem_config: HierarchicalBEMConfig) -> nn.Module:
    """PEFT LoRA on `base` (in place) at BEM's rank, alpha and dropout, on the linears `names`."""
    from peft import LoraConfig, get_peft_model
    from transformers.pytorch_utils import Conv1D

    fan_in_fan_out = any(isinstance(base.get_submodule(name), Conv1D) for name in names)
    config = LoraConfig(r=bem_config.rank, lora_alpha=bem_config.alpha, lora_dropout=bem_config.dropout,
                        target_modules=names, fan_in_fan_out=fan_in_fan_out, bias="none")
    return get_peft_model(base, config)


def count_parameters(model: nn.Module, trainable_only: bool = False) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad or not trainable_only)


def vocab_size(model: nn.Module) -> int:
    size: Any = getattr(getattr(model, "config", None), "vocab_size", None)
    if isinstance(size, int):
        return size
    return int(model.get_input_embeddings().weight.shape[0])
