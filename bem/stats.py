"""`routing_stats()`: what the controller did on the last forward, per module and per level."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .model import BEMModel


def _mean_norm(values: torch.Tensor) -> torch.Tensor:
    """Mean over (batch, tokens) of the per-module code norm; values: (B, T, M, r) -> (M,)."""
    return torch.linalg.vector_norm(values.float(), dim=-1).mean(dim=(0, 1))


def routing_stats(model: "BEMModel") -> dict[str, Any]:
    names = model.bem_module_names
    if model.controller is None:
        return {"routing": False, "modules": {n: {"code_norm": float(model.bem_config.rank) ** 0.5} for n in names}}
    levels = model._hooks.last_levels
    if levels is None:
        raise RuntimeError(
            "routing_stats() needs a forward pass with BEM enabled first, in eval mode or under torch.no_grad() "
            "(training passes keep no statistics)"
        )
    per_level = {key: _mean_norm(levels[key]) for key in ("prefix", "chunk", "dynamic", "codes")}
    token_norm = torch.zeros(len(names))
    if levels["token"] is not None:
        token_norm[model.controller.token_module_indices.cpu()] = _mean_norm(levels["token"]).cpu()
    gate = levels["gate"]
    modules = {}
    for index, name in enumerate(names):
        modules[name] = {
            "code_norm": float(per_level["codes"][index]),
            "prefix_norm": float(per_level["prefix"][index]),
            "chunk_norm": float(per_level["chunk"][index]),
            "token_norm": float(token_norm[index]),
            "clamped_dynamic_norm": float(per_level["dynamic"][index]),
            "token_routed": name in model.token_routed_names,
        }
    return {
        "routing": True,
        "gate_mean": 1.0 if gate is None else float(gate.float().mean()),
        "gate_min": 1.0 if gate is None else float(gate.float().min()),
        "code_norm_mean": float(per_level["codes"].mean()),
        "modules": modules,
    }
