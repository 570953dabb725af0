"""`routing_stats()`: what the controller did on the last forward, per module and per level."""

from __future__ import annotations

from typing import Any

import torch
import torch.nn as nn


def _mean_norm(values: torch.Tensor) -> torch.Tensor:
    """Mean over (batch, tokens) of the per-module code norm; values: (B, T, M, r) -> (M,)."""
    return torch.linalg.vector_norm(values.float(), dim=-1).mean(dim=(0, 1))


def routing_stats(model: nn.Module) -> dict[str, Any]:
    """Of a `BEMModel`, per module: code norm and, when the last forward was not a training pass, each level's norm."""
    names = model.bem_module_names
    if model.controller is None:
        return {"routing": False, "modules": {n: {"code_norm": float(model.bem_config.rank) ** 0.5} for n in names}}
    levels = model._hooks.last_levels
    if levels is None:
        raise RuntimeError("routing_stats() needs a forward pass with BEM enabled first")
    per_level = {key: None if levels[key] is None else _mean_norm(levels[key]).cpu()
                 for key in ("prefix", "chunk", "dynamic", "codes")}
    recorded = per_level["prefix"] is not None
    token_norm = torch.zeros(len(names)) if recorded else None
    if recorded and levels["token"] is not None:
        token_norm[model.controller.token_module_indices.cpu()] = _mean_norm(levels["token"]).cpu()

    def value(key: str, index: int):
        level = token_norm if key == "token" else per_level[key]
        return None if level is None else float(level[index])

    modules = {}
    for index, name in enumerate(names):
        modules[name] = {
            "code_norm": value("codes", index),
            "prefix_norm": value("prefix", index),
            "chunk_norm": value("chunk", index),
            "token_norm": value("token", index),
            "clamped_dynamic_norm": value("dynamic", index),
            "token_routed": name in model.token_routed_names,
        }
    gate = levels["gate"]
    return {
        "routing": True,
        # per-level norms are recorded by eval-mode or no-grad passes; training passes keep codes and gate only
        "levels_recorded": recorded,
        "gate_mean": 1.0 if gate is None else float(gate.float().mean()),
        "gate_min": 1.0 if gate is None else float(gate.float().min()),
        "code_norm_mean": float(per_level["codes"].mean()),
        "modules": modules,
    }
