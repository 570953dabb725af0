"""Two-process data parallel on CPU (gloo, launched with torchrun): both ranks end with the same adapter,
and losses and adapter match a one-process run over the same global batch."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

REPO = Path(__file__).resolve().parent.parent

DRIVER = """
import sys
from safetensors.torch import save_file
from bem.training import load_train_config
from bem.training.trainer import Trainer

config = load_train_config(sys.argv[1], sys.argv[2:])
trainer = Trainer(config, echo=lambda _: None)
trainer.train()
rank = trainer.accelerator.process_index
state = {k: v.contiguous() for k, v in trainer.bem_model.bem_state_dict().items()}
save_file(state, f"{config.training.output_dir}/rank{rank}.safetensors")
"""


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def run_args(data: Path, output_dir: Path, batch_size: int) -> list[str]:
    return [str(REPO / "configs/tiny.yaml"), f"data.train={data}", "data.eval=null", "data.eval_fraction=0.1",
            f"training.output_dir={output_dir}", "training.max_steps=8", f"training.batch_size={batch_size}",
            "training.log_every=1", "training.save_every=4", "logging.console=false"]


def losses(output_dir: Path) -> list[float]:
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r] + [r["eval_loss"] for r in records if "eval_loss" in r]


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    root = tmp_path_factory.mktemp("ddp")
    data = root / "train.jsonl"
    data.write_text("\n".join((REPO / "data/tiny/train.jsonl").read_text().splitlines()[:40]) + "\n")
    driver = root / "driver.py"
    driver.write_text(DRIVER)
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    two = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
                          "--master_addr", "127.0.0.1", "--master_port", str(free_port()), str(driver),
                          *run_args(data, root / "two", batch_size=4)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert two.returncode == 0, two.stderr[-3000:]
    one = subprocess.run([sys.executable, str(driver), *run_args(data, root / "one", batch_size=8)],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=300)
    assert one.returncode == 0, one.stderr[-3000:]
    return root


def test_both_ranks_end_with_identical_adapters(runs):
    rank0 = load_file(str(runs / "two" / "rank0.safetensors"))
    rank1 = load_file(str(runs / "two" / "rank1.safetensors"))
    assert set(rank0) == set(rank1)
    assert all(torch.equal(rank0[k], rank1[k]) for k in rank0)
    saved = load_file(str(runs / "two" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.equal(rank0[k], saved[k]) for k in rank0)
    # each rank wrote its own RNG state into the shared checkpoint
    names = {p.name for p in (runs / "two" / "checkpoints" / "step-00000008").iterdir()}
    assert {"rng_rank0.safetensors", "rng_rank1.safetensors"} <= names


def test_two_processes_match_one_process_with_the_same_global_batch(runs):
    two, one = losses(runs / "two"), losses(runs / "one")
    assert len(two) == len(one) == 9
    assert two[-1] < two[0]
    assert two == pytest.approx(one, rel=1e-5)
    a = load_file(str(runs / "two" / "adapter" / "adapter_model.safetensors"))
    b = load_file(str(runs / "one" / "adapter" / "adapter_model.safetensors"))
    for key in a:
        torch.testing.assert_close(a[key], b[key], rtol=1e-4, atol=1e-5)
