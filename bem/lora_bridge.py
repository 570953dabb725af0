"""The bridge to PEFT LoRA: with every code equal to one, BEM is LoRA with A = V^T and B = U.

Files and tensor dicts only: `BEMModel.from_peft_lora` / `save_as_peft_lora` call these, never the other way round.
`model` below is a `BEMModel`."""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .config import HierarchicalBEMConfig
from .io_utils import atomic_save_safetensors, atomic_write_json
from .modules.controller import GATE_INIT_BIAS

PEFT_CONFIG = "adapter_config.json"
PEFT_WEIGHTS = "adapter_model.safetensors"
_PREFIX = "base_model.model."
_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<which>[AB])(?:\.[^.]+)?\.weight$")


def _read_peft_config(directory: Path) -> dict[str, Any]:
    path = directory / PEFT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"no PEFT adapter in {directory}: {PEFT_CONFIG} is missing")
    config = json.loads(path.read_text())
    if config.get("peft_type") != "LORA":
        raise ValueError(f"{path} describes a {config.get('peft_type')!r} adapter; only LORA can become a BEM")
    for field, neutral in (("use_dora", False), ("rank_pattern", {}), ("alpha_pattern", {})):
        if config.get(field) not in (neutral, None, [], {}):
            raise ValueError(f"PEFT LoRA adapters with {field}={config[field]!r} cannot be represented by BEM")
    return config


@dataclass
class PeftLoraAdapter:
    """A saved PEFT LoRA adapter as BEM reads it: the config of the equivalent BEM, and the weights."""

    config: HierarchicalBEMConfig
    pairs: dict[str, dict[str, torch.Tensor]]  # module name -> {"A": (r, K), "B": (N, r)}
    others: dict[str, torch.Tensor]  # the modules_to_save's weights, by their name under the model
    rank: int
    weights_path: Path


def read_peft_lora(directory: Path, enable_routing: bool = True, **overrides: Any) -> PeftLoraAdapter:
    """Read and check a PEFT LoRA adapter directory (safetensors only)."""
    from safetensors.torch import load_file

    peft_config = _read_peft_config(directory)
    weights_path = directory / PEFT_WEIGHTS
    if not weights_path.is_file():
        raise FileNotFoundError(
            f"no {PEFT_WEIGHTS} in {directory}; BEM reads safetensors only (pickled .bin files are never loaded)"
        )
    tensors = load_file(str(weights_path))
    pairs: dict[str, dict[str, torch.Tensor]] = {}
    others: dict[str, torch.Tensor] = {}  # the modules_to_save's weights, by their name under the model
    for key, value in tensors.items():
        match = _KEY.match(key)
        if match is not None:
            pairs.setdefault(match["module"], {})[match["which"]] = value
        elif peft_config.get("modules_to_save") and key.startswith(_PREFIX):
            others[key[len(_PREFIX):]] = value
        else:
            raise ValueError(f"unexpected tensor '{key}' in {weights_path}: not a LoRA A or B weight")
    incomplete = [m for m, p in pairs.items() if set(p) != {"A", "B"}]
    if incomplete:
        raise ValueError(f"LoRA weights in {weights_path} lack A or B for modules {incomplete[:5]}")

    rank = int(peft_config["r"])
    lora_alpha = float(peft_config.get("lora_alpha", rank))
    # BEM's scaling is alpha / rank; rsLoRA's is lora_alpha / sqrt(rank)
    alpha = lora_alpha * math.sqrt(rank) if peft_config.get("use_rslora") else lora_alpha
    fields = {"rank": rank, "alpha": alpha, "dropout": float(peft_config.get("lora_dropout") or 0.0),
              "target_modules": sorted(pairs), "enable_routing": enable_routing,
              "modules_to_save": peft_config.get("modules_to_save") or None,
              "base_model_name_or_path": peft_config.get("base_model_name_or_path")}
    fields.update(overrides)
    return PeftLoraAdapter(HierarchicalBEMConfig(**fields), pairs, others, rank, weights_path)


def apply_peft_lora(model: nn.Module, adapter: PeftLoraAdapter) -> None:
    """Copy the adapter's weights into a freshly wrapped `model`; on a mismatch the base goes back unwrapped."""
    try:
        _load_lora_weights(model, adapter.pairs, adapter.rank, adapter.others, adapter.weights_path)
    except ValueError:
        model.unload()  # the base model goes back as it was given
        raise


def _load_lora_weights(model: nn.Module, pairs: dict[str, dict[str, torch.Tensor]], rank: int,
                       others: dict[str, torch.Tensor], weights_path: Path) -> None:
    with torch.no_grad():
        for name, module in model.bem_modules():
            lora_a, lora_b = pairs[name]["A"], pairs[name]["B"]
            if lora_a.shape != (rank, module.in_features) or lora_b.shape != (module.out_features, rank):
                raise ValueError(
                    f"LoRA weights for '{name}' are A {tuple(lora_a.shape)}, B {tuple(lora_b.shape)}; this base model "
                    f"needs A ({rank}, {module.in_features}) and B ({module.out_features}, {rank})"
                )
            module.bem_V.copy_(lora_a.t())
            module.bem_U.copy_(lora_b)
        _load_saved_modules(model, others, weights_path)
        if model.controller is not None and model.controller.gate is not None:
            # neutral routing: the gate starts at sigmoid(bias) for every token; cancel it in the static codes
            model.controller.static_codes.fill_(1.0 / torch.sigmoid(torch.tensor(GATE_INIT_BIAS)).item())


def _load_saved_modules(model: nn.Module, tensors: dict[str, torch.Tensor], weights_path: Path) -> None:
    """Copy a PEFT adapter's modules_to_save weights (`<module>.<param>`) into BEM's trained copies."""
    states: dict[str, dict[str, torch.Tensor]] = {name: {} for name in model.saved_module_names}
    for key, value in tensors.items():
        owner = next((name for name in states if key.startswith(name + ".")), None)
        if owner is None:
            raise ValueError(f"unexpected tensor '{_PREFIX}{key}' in {weights_path}: neither LoRA nor a module to save")
        states[owner][key[len(owner) + 1:]] = value
    for name, module in model.saved_modules():
        if not states[name]:
            continue
        expected = module.trained.state_dict()
        if set(states[name]) != set(expected) or any(states[name][k].shape != v.shape for k, v in expected.items()):
            shapes = {k: tuple(v.shape) for k, v in states[name].items()}
            raise ValueError(f"the weights of module to save '{name}' in {weights_path} are {shapes}; this base "
                             f"model's are {({k: tuple(v.shape) for k, v in expected.items()})}")
        module.trained.load_state_dict(states[name])


def save_as_peft_lora(model: nn.Module, directory: Path) -> None:
    if len(model.mixers):
        raise ValueError(
            f"this BEM has {model.bem_config.mixer} mixer blocks, which a LoRA adapter cannot express; only a BEM "
            f"without mixers (mixer: null) and with enable_routing=False can be exported as PEFT LoRA"
        )
    if model.controller is not None:
        raise ValueError(
            "this BEM routes its codes per token, which a LoRA adapter cannot express; only a BEM with "
            "enable_routing=False can be exported as PEFT LoRA"
        )
    config = model.bem_config
    has_conv1d = any(type(m.base_layer).__name__ == "Conv1D" for _, m in model.bem_modules())
    is_causal_lm = type(model.base_model).__name__.endswith("ForCausalLM") or \
        type(model.base_model).__name__ == "GPT2LMHeadModel"
    tensors = {}
    for name, module in model.bem_modules():
        tensors[f"{_PREFIX}{name}.lora_A.weight"] = module.bem_V.detach().t()
        tensors[f"{_PREFIX}{name}.lora_B.weight"] = module.bem_U.detach()
    for name, module in model.saved_modules():
        for key, value in module.trained.state_dict().items():
            tensors[f"{_PREFIX}{name}.{key}"] = value.detach()
    peft_config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM" if is_causal_lm else None,
        "r": config.rank,
        "lora_alpha": config.alpha,
        "lora_dropout": config.dropout,
        "target_modules": list(model.bem_module_names),
        "fan_in_fan_out": has_conv1d,
        "bias": "none",
        "use_rslora": False,
        "use_dora": False,
        "inference_mode": True,
        "init_lora_weights": True,
        "modules_to_save": list(model.saved_module_names) or None,
        "base_model_name_or_path": config.base_model_name_or_path,
    }
    directory.mkdir(parents=True, exist_ok=True)
    atomic_save_safetensors(directory / PEFT_WEIGHTS, tensors, metadata={"format": "pt"})
    atomic_write_json(directory / PEFT_CONFIG, peft_config)
