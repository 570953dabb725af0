"""`bem train` end to end on a few steps of the tiny config, then `bem generate` on what it wrote."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch

from bem.training.cli import generate_main, train_main

REPO = Path(__file__).resolve().parent.parent


pytestmark = pytest.mark.usefixtures("one_thread")


def tiny_args(output_dir: Path, *extra: str) -> list[str]:
    return [str(REPO / "configs/tiny.yaml"),
            f"data.train={REPO / 'data/tiny/train.jsonl'}", f"data.eval={REPO / 'data/tiny/eval.jsonl'}",
            f"training.output_dir={output_dir}", "training.max_steps=40", "training.warmup_steps=0",
            "training.batch_size=8", "training.log_every=5", "training.eval_every=0", "training.save_every=20",
            "logging.console=false", *extra]


@pytest.fixture(scope="module")
def trained_run(tmp_path_factory):
    output_dir = tmp_path_factory.mktemp("tiny") / "run"
    assert train_main(tiny_args(output_dir)) == 0
    return output_dir


def test_loss_is_finite_and_falls(trained_run):
    records = [json.loads(line) for line in (trained_run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 8 and all(math.isfinite(x) for x in losses)
    assert losses[-1] < 0.7 * losses[0]
    [evaluation] = [r for r in records if "eval_loss" in r]
    assert evaluation["step"] == 40 and evaluation["eval_loss"] < losses[0]
    assert math.isclose(evaluation["eval_ppl"], math.exp(evaluation["eval_loss"]), rel_tol=1e-6)
    assert 0.0 < evaluation["routing/gate_mean"] <= 1.0


def test_run_layout_and_checkpoints(trained_run):
    assert (trained_run / "config.yaml").is_file()
    assert (trained_run / "base_model" / "config.json").is_file()
    steps = sorted(p.name for p in (trained_run / "checkpoints").iterdir())
    assert steps == ["step-00000020", "step-00000040"]  # nothing half-written left behind
    state = json.loads((trained_run / "checkpoints/step-00000040/trainer_state.json").read_text())
    assert state["step"] == 40


def test_token_counts_are_exact_wherever_they_are_read(tmp_path):
    """A step's loss and token counts stay on the device until a log line or a checkpoint reads them. With logs
    and checkpoints at different steps, each reads the count of every step before it: the same numbers as a run
    that logs every step."""
    def run(name: str, log_every: int, save_every: int) -> Path:
        output_dir = tmp_path / name
        assert train_main(tiny_args(output_dir, "training.max_steps=9", f"training.log_every={log_every}",
                                    f"training.save_every={save_every}", "training.save_total_limit=null",
                                    "data.eval=null")) == 0
        return output_dir

    def logged(output_dir: Path) -> dict[int, tuple[int, float]]:
        records = [json.loads(line) for line in (output_dir / "metrics.jsonl").read_text().splitlines()]
        return {r["step"]: (r["tokens_seen"], r["loss"]) for r in records if "tokens_seen" in r}

    every_step = logged(run("every_step", 1, 0))
    assert sorted(every_step) == list(range(1, 10))
    sparse_dir = run("sparse", 4, 3)
    sparse = logged(sparse_dir)
    assert sorted(sparse) == [4, 8, 9]
    for step, (tokens, loss) in sparse.items():
        assert tokens == every_step[step][0] and loss == pytest.approx(every_step[step][1], rel=1e-6), step
    for step in (3, 6, 9):
        state = json.loads((sparse_dir / f"checkpoints/step-{step:08d}/trainer_state.json").read_text())
        assert state["tokens_seen"] == every_step[step][0], step


def test_the_loop_runs_with_the_setup_frozen_out_of_the_collectors_walks(tmp_path, monkeypatch):
    """Objects alive when training starts are frozen (a full collection then skips them) for the loop only."""
    import gc

    from bem.training.trainer import Trainer

    frozen_during_steps = []
    step = Trainer._optimizer_step

    def recording_step(self, micro_batches):
        frozen_during_steps.append(gc.get_freeze_count())
        return step(self, micro_batches)

    monkeypatch.setattr(Trainer, "_optimizer_step", recording_step)
    assert gc.get_freeze_count() == 0
    assert train_main(tiny_args(tmp_path / "run", "training.max_steps=3", "data.eval=null")) == 0
    assert len(frozen_during_steps) == 3 and min(frozen_during_steps) > 1000
    assert gc.get_freeze_count() == 0
    # a process that froze objects of its own keeps them frozen, and the trainer adds none
    kept = [object() for _ in range(10)]
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        frozen_during_steps.clear()
        assert train_main(tiny_args(tmp_path / "again", "training.max_steps=2", "data.eval=null")) == 0
        # (the count only falls, as frozen objects die: the trainer froze nothing of its own, thousands of objects)
        assert len(frozen_during_steps) == 2 and max(frozen_during_steps) <= frozen
        assert 0 < gc.get_freeze_count() <= frozen
    finally:
        gc.unfreeze()
    del kept


def test_adapter_reloads_onto_the_saved_base(trained_run):
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from bem import BEMModel

    adapter_dir = trained_run / "adapter"
    config = json.loads((adapter_dir / "adapter_config.json").read_text())
    assert config["bem_config"]["base_model_name_or_path"] == str(trained_run / "base_model")
    model = BEMModel.from_pretrained(AutoModelForCausalLM.from_pretrained(trained_run / "base_model"), adapter_dir)
    saved = load_file(str(adapter_dir / "adapter_model.safetensors"))
    loaded = model.bem_state_dict()
    assert set(saved) == set(loaded)
    assert all(torch.equal(saved[k], loaded[k]) for k in saved)
    assert any(k.endswith(".U") and saved[k].abs().sum() > 0 for k in saved)  # U left its zero init
    final_checkpoint = load_file(str(trained_run / "checkpoints/step-00000040/adapter_model.safetensors"))
    assert all(torch.equal(saved[k], final_checkpoint[k]) for k in saved)


def test_generate_runs_on_the_adapter(trained_run, capsys):
    prompt = "Q: What colour is a lime?\nA:"
    code = generate_main([str(trained_run / "adapter"), "--prompt", prompt, "--max-new-tokens", "8"])
    out = capsys.readouterr().out
    assert code == 0
    assert out.startswith(prompt) and len(out) > len(prompt)


def test_generate_errors_are_usage_errors(tmp_path, capsys):
    assert generate_main([str(tmp_path), "--prompt", "x"]) == 2
    assert "adapter_config.json is missing" in capsys.readouterr().err
    assert generate_main([str(tmp_path)]) == 2
    assert "--prompt" in capsys.readouterr().err
