"""Checkpoint directories: `output_dir/checkpoints/step-00000040/`, complete or absent.

Every file is written into a hidden temp directory, which is renamed into place last; a run killed at
any moment leaves only whole checkpoints. Contents:

    adapter_model.safetensors          bem_state_dict() of the adapter and controller (full tensors)
    optimizer.safetensors/.json        optimizer state (tensors / everything else), or under FSDP
    optimizer_rank<R>.safetensors/.json  each process's shard of it
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
from typing import Any, Callable, Optional, Sequence

import torch

from ..io_utils import atomic_save_safetensors, atomic_write_json
from .schema import ConfigError
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
    # "fsdp": the optimizer state is saved as one shard per process; "ddp": whole, by the main process
    distributed: str = "ddp"


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


def optimizer_files(directory: Path, state: TrainerState, rank: int) -> tuple[Path, Path]:
    """Where the optimizer state of `rank` is: its own shard files under FSDP, the shared ones otherwise."""
    stem = f"optimizer_rank{rank}" if state.distributed == "fsdp" else "optimizer"
    return directory / f"{stem}.safetensors", directory / f"{stem}.json"


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
    sharded: Sequence[str] = (),
) -> Path:
    """Write one checkpoint from every process: each writes its RNG state, under FSDP also its shard of the
    optimizer state (`optimizer_state`, whose tensors named in `sharded` are shards); the main process the rest."""
    root = checkpoints_dir(output_dir)
    final = root / f"step-{state.step:08d}"
    tmp = root / f".tmp-step-{state.step:08d}"
    if is_main:
        if tmp.exists():
            shutil.rmtree(tmp)  # left by a run killed while saving
        tmp.mkdir(parents=True)
    barrier()
    save_rng_state(tmp / f"rng_rank{rank}.safetensors", tmp / f"rng_rank{rank}.json")
    if is_main or state.distributed == "fsdp":
        save_optimizer_state(optimizer_state, *optimizer_files(tmp, state, rank), sharded=sharded)
    if is_main:
        atomic_save_safetensors(tmp / "adapter_model.safetensors", adapter_state)
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


def check_resumable(saved: TrainerState, run: TrainerState, directory: Path) -> None:
    """Refuse a checkpoint whose data position or optimizer layout does not carry over to this run."""
    saved_shape = (saved.world_size, saved.batch_size, saved.gradient_accumulation_steps)
    run_shape = (run.world_size, run.batch_size, run.gradient_accumulation_steps)
    if saved_shape != run_shape:
        raise ConfigError("training.resume", f"{directory} was written by a run with {saved_shape[0]} processes x "
                                             f"batch_size {saved_shape[1]} x gradient_accumulation_steps "
                                             f"{saved_shape[2]}; this run has {run_shape[0]} x {run_shape[1]} x "
                                             f"{run_shape[2]}, so the data position would not match")
    if saved.distributed != run.distributed:
        layout = {"fsdp": "sharded over the processes", "ddp": "whole"}
        raise ConfigError("training.distributed", f"{directory} was written by a run with {saved.distributed} (its "
                                                  f"optimizer state is {layout[saved.distributed]}); this run uses "
                                                  f"{run.distributed}: resume with training.distributed="
                                                  f"{saved.distributed}")


def check_param_groups(saved_groups: list[dict], run_groups: list[dict], directory: Path) -> None:
    """Refuse optimizer state whose param groups (their number, and the parameters in each) differ from this
    run's optimizer: loaded anyway, each moment would land on another parameter, or torch would refuse it
    without saying why. An FSDP run keeps the parameters it leaves whole in a group of their own, which runs
    of BEM before that did not."""
    saved = [len(group["params"]) for group in saved_groups]
    run = [len(group["params"]) for group in run_groups]
    if saved != run:
        raise ConfigError("training.resume", f"{directory} holds optimizer state for param groups of {saved} "
                                             f"parameters, this run's optimizer has groups of {run}: the "
                                             f"checkpoint was written with another grouping of the trainable "
                                             f"parameters (another adapter layout, or an FSDP run that kept them "
                                             f"in one group); start a new run from its adapter instead")


def load_checkpoint(directory: Path, rank: int) -> tuple[TrainerState, dict, dict, list[str], dict]:
    """(trainer state, adapter tensors, this rank's optimizer state dict, the names of its tensors that are
    shards, scheduler record); restores this rank's RNGs."""
    from safetensors.torch import load_file

    state = read_trainer_state(directory)
    adapter = load_file(str(directory / "adapter_model.safetensors"))
    tensors_file, json_file = optimizer_files(directory, state, rank)
    if not tensors_file.is_file():
        raise FileNotFoundError(f"{directory} has no {tensors_file.name}: it was written by a run of "
                                f"{state.world_size} processes ({state.distributed})")
    optimizer, sharded = load_optimizer_state(tensors_file, json_file)
    scheduler = json.loads((directory / "scheduler.json").read_text())
    rng_tensors = directory / f"rng_rank{rank}.safetensors"
    if rng_tensors.is_file():
        load_rng_state(rng_tensors, directory / f"rng_rank{rank}.json")
    return state, adapter, optimizer, sharded, scheduler


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
