"""`bem train` with each mixer's tiny config: a few steps train the mixers, and the adapter they write loads
back with its mixers and generates."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from bem.training.cli import generate_main, train_main

REPO = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.usefixtures("one_thread")


@pytest.mark.parametrize("kind", ["hyena", "mlstm"])
def test_a_tiny_mixer_config_trains_saves_and_generates(kind, tmp_path, capsys):
    output_dir = tmp_path / "run"
    args = [str(REPO / f"configs/tiny_{kind}.yaml"), f"data.train={REPO / 'data/tiny/train.jsonl'}",
            f"data.eval={REPO / 'data/tiny/eval.jsonl'}", f"training.output_dir={output_dir}",
            "training.max_steps=12", "training.warmup_steps=0", "training.batch_size=8", "training.log_every=3",
            "training.eval_every=0", "training.save_every=0", "logging.console=false"]
    assert train_main(args) == 0
    records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert losses and all(math.isfinite(x) for x in losses) and losses[-1] < losses[0]
    weights = load_file(str(output_dir / "adapter" / "adapter_model.safetensors"))
    out_proj = [v for k, v in weights.items() if k.startswith("mixers.") and k.endswith("out_proj.weight")]
    assert len(out_proj) == 2 and all(torch.count_nonzero(w) > 0 for w in out_proj)  # trained away from zero
    config = json.loads((output_dir / "adapter" / "adapter_config.json").read_text())
    assert config["bem_config"]["mixer"] == kind
    capsys.readouterr()
    assert generate_main([str(output_dir / "adapter"), "--prompt", "Q: Say 'river' three times.\nA:",
                          "--max-new-tokens", "4"]) == 0
    assert "Q: Say 'river' three times." in capsys.readouterr().out
