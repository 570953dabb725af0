"""Adapter files: `adapter_config.json` + `adapter_model.safetensors`, written atomically, read without pickle.

Files and tensor dicts only: the model module calls these (`BEMModel.save_pretrained` / `from_pretrained`), never
the other way round. `model` below is a `BEMModel`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch
import torch.nn as nn

from .config import HierarchicalBEMConfig
from .io_utils import atomic_save_safetensors, atomic_write_json
from .modules.bem_linear import linear_features

CONFIG_NAME = "adapter_config.json"
WEIGHTS_NAME = "adapter_model.safetensors"
FORMAT = "bem"
FORMAT_VERSION = 1


def save_adapter(model: nn.Module, directory: Path) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    config = model.bem_config.to_dict()
    # pin the exact set of wrapped modules so loading rebuilds the same adapter on any config defaults
    config["target_modules"] = list(model.bem_module_names)
    config["token_routing_modules"] = list(model.token_routed_names) or None
    record = {"format": FORMAT, "format_version": FORMAT_VERSION, "bem_config": config,
              "module_shapes": {name: [m.in_features, m.out_features] for name, m in model.bem_modules()}}
    # weights first, then the config: a directory with a config always has matching weights
    atomic_save_safetensors(directory / WEIGHTS_NAME, model.bem_state_dict(), metadata={"format": "pt"})
    atomic_write_json(directory / CONFIG_NAME, record)


def read_adapter_config(directory: Path) -> dict[str, Any]:
    path = directory / CONFIG_NAME
    if not path.is_file():
        hint = ""
        if (directory / "config.json").is_file():
            hint = (" (this folder holds a model, with its config.json: pass the folder save_pretrained wrote the "
                    "adapter to)")
        elif (directory / "model.safetensors").is_file():
            hint = (" (this folder holds a whole model's state dict, as transformers' Trainer writes for a "
                    "BEMModel: train with bem.training.hf_trainer.BEMTrainer, whose checkpoints hold the adapter, "
                    "or call model.save_pretrained)")
        raise FileNotFoundError(f"no BEM adapter in {directory}: {CONFIG_NAME} is missing{hint}")
    try:
        record = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if not isinstance(record, dict) or record.get("format") != FORMAT:
        raise ValueError(f"{path} is not a BEM adapter config (a PEFT LoRA adapter? use BEMModel.from_peft_lora)")
    if record.get("format_version") != FORMAT_VERSION:
        raise ValueError(f"{path} has format_version {record.get('format_version')}, this BEM reads {FORMAT_VERSION}")
    return record


def read_adapter(base_model: nn.Module, directory: Path,
                 **overrides: Any) -> tuple[HierarchicalBEMConfig, dict[str, torch.Tensor]]:
    """The saved adapter's config (with `overrides`) and weights, after checking that `base_model` has every
    wrapped module at the saved shapes."""
    record = read_adapter_config(directory)
    config_data = dict(record["bem_config"])
    config_data.update(overrides)
    config = HierarchicalBEMConfig.from_dict(config_data)
    _check_base_shapes(base_model, record.get("module_shapes", {}), directory)
    return config, _read_weights(directory)


def apply_adapter(model: nn.Module, state: dict[str, torch.Tensor], is_trainable: bool) -> None:
    """Load `state` into a freshly wrapped `model`; on a mismatch the base goes back unwrapped and the error
    stands. Frozen and in eval mode unless `is_trainable`."""
    try:
        model.load_bem_state_dict(state)
    except ValueError:
        model.unload()
        raise
    model.requires_grad_(False)
    if is_trainable:
        for param in model.adapter_parameters():
            param.requires_grad_(True)
    else:
        model.eval()


def load_adapter_weights(model: nn.Module, directory: Path) -> None:
    """Load a saved adapter's weights into `model`, which must have the same modules and shapes (a resumed
    run); nothing changes on error."""
    read_adapter_config(directory)
    model.load_bem_state_dict(_read_weights(directory))


def _read_weights(directory: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    weights_path = directory / WEIGHTS_NAME
    if not weights_path.is_file():
        raise FileNotFoundError(f"no BEM adapter weights in {directory}: {WEIGHTS_NAME} is missing")
    return load_file(str(weights_path))  # safetensors: plain tensors, no unpickling


def _check_base_shapes(base_model: nn.Module, shapes: dict, directory: Path) -> None:
    modules = dict(base_model.named_modules())
    for name, (in_features, out_features) in shapes.items():
        module = modules.get(name)
        if module is None:
            raise ValueError(f"the adapter in {directory} wraps module '{name}', which this base model does not have")
        try:
            actual = linear_features(module)
        except TypeError:
            raise ValueError(f"module '{name}' of this base model is a {type(module).__name__}, not a linear") from None
        if actual != (in_features, out_features):
            raise ValueError(
                f"module '{name}' is {actual[0]} -> {actual[1]} in this base model but the adapter in {directory} "
                f"was trained for {in_features} -> {out_features}"
            )
