"""The training-throughput benchmark runs end to end (tiny, on CPU) and prints its comparison table."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def test_train_throughput_tiny_runs_and_reports_every_variant(tmp_path):
    out = tmp_path / "results.json"
    done = subprocess.run(
        [sys.executable, "benchmarks/train_throughput.py", "--config", "configs/train_llama_1b.yaml", "--tiny",
         "--steps", "2", "--warmup", "1", "--rounds", "1", "--device", "cpu", "--json", str(out)],
        cwd=REPO, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    for name in ("BEM (reference path)", "BEM (fused kernels)", "PEFT LoRA"):
        assert name in done.stdout
    rows = {row["variant"]: row for row in json.loads(out.read_text())["rows"]}
    assert rows["PEFT LoRA"]["speed_vs_lora"] == 1.0
    assert all(row["tokens_per_s"] > 0 for row in rows.values())
    # same rank and targets: LoRA has r * (K + N) per projection; BEM adds its controller on top
    assert rows["BEM (reference path)"]["trainable_params"] > rows["PEFT LoRA"]["trainable_params"] > 0
    assert "reference path ran" in rows["BEM (fused kernels)"]["note"]  # no CUDA here, and it says so
