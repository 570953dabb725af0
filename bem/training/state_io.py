"""Training state to and from safetensors + JSON: optimizer, RNGs. Nothing here pickles or unpickles."""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any, Sequence

import torch

from ..io_utils import atomic_save_safetensors, atomic_write_json


def save_optimizer_state(state: dict[str, Any], tensors_path: Path, json_path: Path,
                         sharded: Sequence[str] = ()) -> None:
    """Split `optimizer.state_dict()` into its tensors (safetensors) and everything else (JSON). `sharded` names
    the tensors (`<param id>.<name>`) that are one process's shard of a larger tensor (FSDP), recorded as such."""
    tensors: dict[str, torch.Tensor] = {}
    scalars: dict[str, dict[str, Any]] = {}
    for param_id, param_state in state["state"].items():
        for name, value in param_state.items():
            if isinstance(value, torch.Tensor):
                tensors[f"{param_id}.{name}"] = value.contiguous()
            else:
                scalars.setdefault(str(param_id), {})[name] = value
    atomic_save_safetensors(tensors_path, tensors)
    atomic_write_json(json_path, {"param_groups": state["param_groups"], "scalars": scalars, "sharded": list(sharded)})


def load_optimizer_state(tensors_path: Path, json_path: Path) -> tuple[dict[str, Any], list[str]]:
    """The optimizer state dict, and the names of its tensors that were saved as shards."""
    from safetensors.torch import load_file

    record = json.loads(json_path.read_text())
    state: dict[int, dict[str, Any]] = {}
    for key, value in load_file(str(tensors_path)).items():
        param_id, name = key.split(".", 1)
        state.setdefault(int(param_id), {})[name] = value
    for param_id, values in record["scalars"].items():
        state.setdefault(int(param_id), {}).update(values)
    groups = record["param_groups"]
    for group in groups:
        for key, value in group.items():
            if isinstance(value, list) and key != "params":
                group[key] = tuple(value)  # JSON turned tuples such as Adam's betas into lists
    return {"state": state, "param_groups": groups}, list(record.get("sharded", []))


def save_rng_state(tensors_path: Path, json_path: Path) -> None:
    """This process's Python, NumPy and torch (CPU and every CUDA device) generator states."""
    tensors = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for index, cuda_state in enumerate(torch.cuda.get_rng_state_all()):
            tensors[f"torch_cuda_{index}"] = cuda_state
    version, internal, gauss = random.getstate()
    record: dict[str, Any] = {"python": [version, list(internal), gauss]}
    try:
        import numpy as np

        kind, keys, pos, has_gauss, cached = np.random.get_state()
        record["numpy"] = [kind, keys.tolist(), int(pos), int(has_gauss), float(cached)]
    except ImportError:
        pass
    atomic_save_safetensors(tensors_path, tensors)
    atomic_write_json(json_path, record)


def load_rng_state(tensors_path: Path, json_path: Path) -> None:
    from safetensors.torch import load_file

    tensors = load_file(str(tensors_path))
    torch.set_rng_state(tensors["torch_cpu"])
    cuda_states = [tensors[k] for k in sorted(k for k in tensors if k.startswith("torch_cuda_"))]
    if cuda_states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda_states[: torch.cuda.device_count()])
    record = json.loads(json_path.read_text())
    version, internal, gauss = record["python"]
    random.setstate((version, tuple(internal), gauss))
    if "numpy" in record:
        import numpy as np

        kind, keys, pos, has_gauss, cached = record["numpy"]
        np.random.set_state((kind, np.array(keys, dtype=np.uint32), pos, has_gauss, cached))
