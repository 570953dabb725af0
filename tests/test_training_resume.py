"""Stopping a run and resuming it ends with exactly the adapter of a run that was never stopped (CPU).

The small data set (40 records, 5 optimizer steps per epoch with accumulation 2) makes the runs cross
epoch boundaries, and adapter dropout makes the RNG state matter.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bem.training import load_train_config
from bem.training.cli import train_main
from bem.training.trainer import train

REPO = Path(__file__).resolve().parent.parent
STEPS = 30


pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.fixture(scope="module")
def small_data(tmp_path_factory) -> Path:
    lines = (REPO / "data/tiny/train.jsonl").read_text().splitlines()[:40]
    path = tmp_path_factory.mktemp("data") / "train.jsonl"
    path.write_text("\n".join(lines) + "\n")
    return path


def overrides(data: Path, output_dir: Path, *extra: str) -> list[str]:
    return [f"data.train={data}", "data.eval=null", "data.eval_fraction=0.1", f"training.output_dir={output_dir}",
            f"training.max_steps={STEPS}", "training.batch_size=4", "training.gradient_accumulation_steps=2",
            "training.warmup_steps=3", "training.save_every=4", "training.save_total_limit=null",
            "training.eval_every=10", "training.log_every=1", "bem.dropout=0.1", "logging.console=false", *extra]


def adapter(path: Path) -> dict[str, torch.Tensor]:
    return load_file(str(path / "adapter_model.safetensors"))


def assert_same_adapter(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert set(a) == set(b)
    different = [k for k in a if not torch.equal(a[k], b[k])]
    assert not different, f"{len(different)} tensors differ, e.g. {different[:3]}"


@pytest.fixture(scope="module")
def uninterrupted(small_data, tmp_path_factory) -> Path:
    output_dir = tmp_path_factory.mktemp("full") / "run"
    result = train(load_train_config(REPO / "configs/tiny.yaml", overrides(small_data, output_dir)), echo=lambda _: None)
    assert result.step == STEPS
    return output_dir


def losses(output_dir: Path) -> dict[int, float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return {r["step"]: r["loss"] for r in records if "loss" in r}


def test_stop_and_resume_matches_uninterrupted(small_data, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    quiet = lambda _: None  # noqa: E731
    stopped = train(load_train_config(REPO / "configs/tiny.yaml", overrides(small_data, output_dir)),
                    stop_at_step=11, echo=quiet)
    assert stopped.adapter_dir is None and stopped.step == 11
    assert not (output_dir / "adapter").exists()
    # steps 9..11 are lost: the latest checkpoint is step 8, in the middle of the second epoch
    config = load_train_config(REPO / "configs/tiny.yaml", overrides(small_data, output_dir, "training.resume=latest"))
    result = train(config, echo=quiet)
    assert result.step == STEPS
    assert_same_adapter(adapter(uninterrupted / "adapter"), adapter(output_dir / "adapter"))
    assert losses(output_dir) == losses(uninterrupted)  # metrics past the checkpoint were rewritten, not duplicated


def test_resume_from_an_explicit_checkpoint(small_data, uninterrupted, tmp_path):
    # a finished run's step-12 checkpoint, copied into a fresh output dir, continues to the same end
    import shutil

    output_dir = tmp_path / "run"
    shutil.copytree(uninterrupted / "checkpoints" / "step-00000012", tmp_path / "step-00000012")
    shutil.copytree(uninterrupted / "base_model", output_dir / "base_model")
    config = load_train_config(REPO / "configs/tiny.yaml",
                               overrides(small_data, output_dir, f"training.resume={tmp_path / 'step-00000012'}"))
    train(config, echo=lambda _: None)
    assert_same_adapter(adapter(uninterrupted / "adapter"), adapter(output_dir / "adapter"))


def test_sigkill_then_resume_matches_uninterrupted(small_data, uninterrupted, tmp_path):
    output_dir = tmp_path / "run"
    args = overrides(small_data, output_dir)
    process = subprocess.Popen([sys.executable, "-m", "bem", "train", str(REPO / "configs/tiny.yaml"), *args],
                               cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                               env={**os.environ, "OMP_NUM_THREADS": "1"})
    first = output_dir / "checkpoints" / "step-00000004"
    deadline = time.monotonic() + 240
    while not first.exists() and process.poll() is None and time.monotonic() < deadline:
        time.sleep(0.005)
    process.send_signal(signal.SIGKILL)
    process.wait()
    assert process.returncode == -signal.SIGKILL, "the run ended before it could be killed mid-way"
    assert not (output_dir / "adapter").exists()
    leftovers = [p.name for p in (output_dir / "checkpoints").iterdir() if not p.name.startswith(("step-", ".tmp-"))]
    assert not leftovers
    code = train_main([str(REPO / "configs/tiny.yaml"), *args, "training.resume=latest"])
    assert code == 0
    assert_same_adapter(adapter(uninterrupted / "adapter"), adapter(output_dir / "adapter"))


def test_a_checkpoint_is_refused_by_a_run_it_does_not_fit(tmp_path):
    import dataclasses

    from bem.training import ConfigError
    from bem.training.checkpoint import TrainerState, check_resumable

    run = TrainerState(step=0, epoch=0, micro_batch_in_epoch=0, tokens_seen=0, world_size=2, batch_size=4,
                       gradient_accumulation_steps=1, distributed="ddp")
    check_resumable(dataclasses.replace(run, step=8, epoch=1), run, tmp_path)
    with pytest.raises(ConfigError, match="training.distributed=fsdp") as sharded:
        check_resumable(dataclasses.replace(run, distributed="fsdp"), run, tmp_path)
    assert sharded.value.key == "training.distributed"
    with pytest.raises(ConfigError, match="1 processes x batch_size 4") as shape:
        check_resumable(dataclasses.replace(run, world_size=1), run, tmp_path)
    assert shape.value.key == "training.resume"


def test_optimizer_state_of_another_param_grouping_is_refused(tmp_path):
    from bem.training import ConfigError
    from bem.training.checkpoint import check_param_groups

    run = [{"params": [0, 1, 2]}, {"params": [3]}]
    check_param_groups([{"params": [0, 1, 2]}, {"params": [3]}], run, tmp_path)
    with pytest.raises(ConfigError, match=r"param groups of \[4\] parameters.*groups of \[3, 1\]") as refused:
        check_param_groups([{"params": [0, 1, 2, 3]}], run, tmp_path)  # FSDP state from one group
    assert refused.value.key == "training.resume" and str(tmp_path) in str(refused.value)


def test_a_checkpoint_from_before_the_strategy_was_recorded_reads_as_ddp(tmp_path):
    from bem.training.checkpoint import read_trainer_state

    (tmp_path / "trainer_state.json").write_text(json.dumps(
        {"step": 4, "epoch": 0, "micro_batch_in_epoch": 4, "tokens_seen": 100, "world_size": 1, "batch_size": 8,
         "gradient_accumulation_steps": 1}))
    assert read_trainer_state(tmp_path).distributed == "ddp"


def test_the_adapter_starts_the_same_whether_the_fresh_base_was_built_or_loaded(small_data, tmp_path):
    """A run without `model.path` builds a random base and saves it; the next run (a resume, or another process
    of the same run that comes after the save) loads it instead, drawing nothing from the random generator. The
    adapter's initial weights must not depend on which happened: processes that disagree would train apart."""
    from bem.training.trainer import Trainer

    config = load_train_config(REPO / "configs/tiny.yaml", overrides(small_data, tmp_path / "run"))
    built = Trainer(config, echo=lambda _: None)
    assert (built.base_dir / "config.json").is_file()
    loaded = Trainer(config, echo=lambda _: None)  # finds the base the first one saved
    assert_same_adapter(built.bem_model.bem_state_dict(), loaded.bem_model.bem_state_dict())
