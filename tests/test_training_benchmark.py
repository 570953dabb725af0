"""The training-throughput benchmark on the tiny profile (CPU): both setups, both variants, one table, and
the precision each setup promises."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parent.parent


def _load(name: str):
    spec = importlib.util.spec_from_file_location(name, REPO / "benchmarks" / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


bench = _load("train_throughput")
setups = sys.modules["train_setups"]


def test_tiny_run_reports_both_setups_for_bem_and_lora(tmp_path, capsys):
    out = tmp_path / "results.json"
    assert bench.main(["--repeats", "5", "--batch-size", "1", "--seq-len", "16", "--device", "cpu",
                       "--json", str(out)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(row["config"], row["setup"]) for row in rows] == [("tiny", "bf16"), ("tiny", "autocast")]
    for row in rows:
        assert row["repeats"] == 5 and set(row["samples_ms"]) == {"bem", "lora"}
        assert all(len(v) == 5 for v in row["samples_ms"].values())
        assert row["bem_tokens_per_s"] > 0 and row["lora_tokens_per_s"] > 0 and row["tokens_per_step"] == 16
        speed = row["speed_vs_lora"]
        assert speed["low"] <= speed["point"] <= speed["high"]  # five repeats: [min, max] of the ratios
        # same rank and targets: LoRA has r * (K + N) per projection; BEM adds its controller on top
        assert row["trainable_parameters"]["bem"] > row["trainable_parameters"]["lora"] > 0
        assert row["memory"]["bem"]["resident_bytes"] > 0 and row["memory"]["bem"]["peak_bytes"] is None  # CPU
        assert row["note"].startswith("reference path: the tensors are on cpu")
        assert any(line.startswith("tiny") and line.split()[1] == row["setup"] for line in table.splitlines())
    assert "bf16: bf16 base, bfloat16 adapters, no autocast" in table
    assert "autocast: bf16 base, float32 adapters, bf16 autocast" in table


@pytest.mark.parametrize("name, adapter_dtype", [("bf16", torch.bfloat16), ("autocast", torch.float32)])
def test_setups_cast_the_adapters_of_both_variants(name, adapter_dtype):
    from bem.profiling.config import ProfileConfig
    from bem.profiling.models import build_variants, load_base_model
    from dataclasses import replace

    config = ProfileConfig()
    base = load_base_model(replace(config.model, dtype="bfloat16"), torch.device("cpu"), seed=0)
    variants = build_variants(base, config.bem_config(), with_lora=True)
    for model in (variants.bem, variants.lora):
        setups.set_trainable_dtype(model, setups.SETUPS[name].adapter_dtype)
        assert {p.dtype for p in model.parameters() if p.requires_grad} == {adapter_dtype}
        assert {p.dtype for p in model.parameters() if not p.requires_grad} == {torch.bfloat16}


def test_bad_setups_and_configs_exit_2(capsys):
    assert bench.main(["--setups", "fp8"]) == 2
    assert "--setups takes names of bf16, autocast" in capsys.readouterr().err
    assert bench.main(["--sweep", "nope"]) == 2
    assert "no profile config named 'nope'" in capsys.readouterr().err


def test_two_processes_under_fsdp_against_one_for_bem_and_lora(tmp_path, capsys):
    """`--processes 2`: the one-process launch and an FSDP launch of two processes (gloo), BEM and LoRA in each."""
    out = tmp_path / "processes.json"
    profiles = tmp_path / "profiles"
    assert bench.main(["--processes", "2", "--strategies", "fsdp", "--setups", "bf16", "--device", "cpu",
                       "--batch-size", "2", "--seq-len", "16", "--repeats", "2", "--json", str(out),
                       "--profile", str(profiles)]) == 0
    table = capsys.readouterr().out
    rows = json.loads(out.read_text())["rows"]
    assert [(r["strategy"], r["processes"], r["variant"]) for r in rows] == [
        ("one", 1, "bem"), ("one", 1, "lora"), ("fsdp", 2, "bem"), ("fsdp", 2, "lora")]
    by = {(r["strategy"], r["variant"]): r for r in rows}
    for row in rows:
        assert "error" not in row and row["setup"] == "bf16" and row["repeats"] == 2 and len(row["step_ms"]) == 2
        assert row["tokens_per_s"] == pytest.approx(row["tokens_per_s_per_process"] * row["processes"])
        assert row["peak_bytes_by_process"] is None  # CPU
        assert all(torch.isfinite(torch.tensor(row["losses"])))
    assert by["one", "bem"]["per_process_vs_one"] == 1.0
    assert by["fsdp", "bem"]["bem_vs_lora"] == pytest.approx(
        by["fsdp", "bem"]["tokens_per_s"] / by["fsdp", "lora"]["tokens_per_s"])
    for variant in ("bem", "lora"):
        # process 0 draws the same first batch and builds the same model in both launches
        assert by["fsdp", variant]["losses"][0] == pytest.approx(by["one", variant]["losses"][0], abs=1e-2)
    assert any(line.split()[:4] == ["bf16", "fsdp", "2", "bem"] for line in table.splitlines())
    # both variants of the FSDP launch are sharded (the second prepare of a CPU run once fell back to DDP);
    # BEM's controller stays whole, a small share of its parameters
    assert by["one", "bem"]["sharded_fraction"] == by["one", "lora"]["sharded_fraction"] == 0
    assert by["fsdp", "lora"]["sharded_fraction"] == 1.0
    assert 0.9 < by["fsdp", "bem"]["sharded_fraction"] < 1.0
    # --profile: two more traced steps per launch and variant, process 0's operator tables
    for strategy in ("one", "fsdp"):
        for variant in ("bem", "lora"):
            text = (profiles / f"bf16_{strategy}_{variant}.txt").read_text()
            assert text.startswith(f"{variant}, {strategy}, bf16, process 0") and "aten::mm" in text
            assert ("FSDP::all_gather" in text) == (strategy == "fsdp")
            # one warm-up step (the tiny profile's timing.warmup), the timed ones, the two traced
            assert len(by[strategy, variant]["losses"]) == 1 + len(by[strategy, variant]["step_ms"]) + 2


def test_bad_process_settings_are_refused(capsys):
    assert bench.main(["--processes", "2", "--strategies", "zero"]) == 2
    assert "--strategies takes names of ddp, fsdp, got 'zero'" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--processes", "0"])
    assert "--processes must be at least 1" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        bench.main(["--processes", "2", "--sweep"])
    assert "--processes takes one --config" in capsys.readouterr().err
