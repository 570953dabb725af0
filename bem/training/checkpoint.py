"""Checkpoint directories: `output_dir/checkpoints/step-00000040/`, complete or absent.

Every file is written into a hidden temp directory, which is renamed into place last; a run killed at
any moment leaves only whole checkpoints. Contents:

    adapter_model.safetensors          bem_state_dict() of the adapter and controller
    optimizer.safetensors/.json        optimizer state (tensors / everything else)
    scheduler.json                     LR scheduler and gradient scaler state
    rng_rank<R>.safetensors/.json      each process's RNG states
    trainer_state.json                 step, data position, run shape; written last
"""

from __future__ import annotations

import json
import os
import re
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from ..io_utils import atomic_save_safetensors, atomic_write_json
from .state_io import load_optimizer_state, load_rng_state, save_optimizer_state, save_rng_state

STEP_DIR = re.compile(r"^step-(\d+)$")
STATE_FILE = "trainer_state.json"


@dataclass
class TrainerState:
    step: int  # optimizer steps completed
    epoch: int  # the epoch the next micro-batch comes from
    micro_batch_in_epoch: int  # micro-batches of that epoch already consumed
    tokens_seen: int  # target tokens trained on, all processes
    world_size: int
    batch_size: int
    gradient_accumulation_steps: int


def checkpoints_dir(output_dir: Path) -> Path:
    return output_dir / "checkpoints"


def list_checkpoints(output_dir: Path) -> list[Path]:
    """Complete checkpoints (they have a trainer state), oldest first."""
    root = checkpoints_dir(output_dir)
    if not root.is_dir():
        return []
    found = [(int(m.group(1)), p) for p in root.iterdir() if (m := STEP_DIR.match(p.name)) and (p / STATE_FILE).is_file()]
    return [p for _, p in sorted(found)]


def latest_checkpoint(output_dir: Path) -> Optional[Path]:
    found = list_checkpoints(output_dir)
    return found[-1] if found else None


def save_checkpoint(
    output_dir: Path,
    state: TrainerState,
    adapter_state: Optional[dict[str, torch.Tensor]],
    optimizer_state: Optional[dict[str, Any]],
    scheduler_state: Optional[dict[str, Any]],
    rank: int,
    is_main: bool,
    barrier: Callable[[], None],
    keep: Optional[int],
) -> Path:
    """Write one checkpoint from every process (each writes its RNG state; the main one the rest)."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    barrier()
    save_rng_state(tmp / f"rng_rank{rank}.safetensors", tmp / f"rng_rank{rank}.json")
    if is_main:
        atomic_save_safetensors(tmp / "adapter_model.safetensors", adapter_state)
        save_optimizer_state(optimizer_state, tmp / "optimizer.safetensors", tmp / "optimizer.json")
        atomic_write_json(tmp / "scheduler.json", scheduler_state)
    barrier()
    if is_main:
        atomic_write_json(tmp / STATE_FILE, asdict(state))
        if final.exists():  # the same step saved by an earlier, interrupted attempt
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
        if keep is not None:
            for old in list_checkpoints(output_dir)[:-keep]:
                shutil.rmtree(old, ignore_errors=True)
    barrier()
    return final


def read_trainer_state(directory: Path) -> TrainerState:
    path = directory / STATE_FILE
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a complete checkpoint ({STATE_FILE} is missing)")
    return TrainerState(**json.loads(path.read_text()))


def load_checkpoint(directory: Path, rank: int) -> tuple[TrainerState, dict, dict, dict]:
    """(trainer state, adapter tensors, optimizer state dict, scheduler record); restores this rank's RNGs."""
    from safetensors.torch import load_file

    state = read_trainer_state(directory)
    adapter = load_file(str(directory / "adapter_model.safetensors"))
    optimizer = load_optimizer_state(directory / "optimizer.safetensors", directory / "optimizer.json")
    scheduler = json.loads((directory / "scheduler.json").read_text())
    rng_tensors = directory / f"rng_rank{rank}.safetensors"
    if rng_tensors.is_file():
        load_rng_state(rng_tensors, directory / f"rng_rank{rank}.json")
    return state, adapter, optimizer, scheduler


def _fsync_dir(path: Path) -> None:
    # make the rename itself durable, not only the files
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
