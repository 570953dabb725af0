"""`bem profile` end to end on the default tiny CPU profile: report, schema, chart, exit codes."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from bem.profiling.cli import main
from bem.profiling.schema import validate_report

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def default_run(tmp_path_factory):
    """The default profile (no --config), two repeats, with a gate it cannot miss."""
    out = tmp_path_factory.mktemp("profile")
    code = main(["--repeats", "2", "--output-dir", str(out), "--max-overhead", "1000", "--quiet"])
    report_path, chart_path = out / "tiny.json", out / "tiny.png"
    return code, json.loads(report_path.read_text()), report_path, chart_path


def test_default_profile_writes_a_report_matching_its_schema(default_run):
    code, report, report_path, _ = default_run
    assert code == 0
    assert validate_report(report) == []
    kinds = [s["kind"] for s in report["settings"]]
    assert kinds == ["prefill", "prefill", "decode", "decode", "train"]
    assert report["model"]["bem_modules"] == 14  # 2 layers x 7 projections
    assert report["model"]["lora_trainable_parameters"] is not None
    assert all(s["lora"] is not None and s["lora"] > 0 for s in report["settings"])
    assert [r["call"] for r in report["routing"]] == ["forward", "forward", "step", "step"]
    assert all(len(samples) == 2 for s in report["settings"] for samples in s["samples_ms"].values())
    train = report["settings"][-1]
    assert set(train["memory"]) == {"base", "bem", "lora"}
    assert all(m["saved_for_backward_bytes"] > 0 for m in train["memory"].values())
    assert not list(report_path.parent.glob(".*.tmp"))  # the atomic write left no temp file


def test_chart_is_a_non_empty_png(default_run):
    chart = default_run[3]
    data = chart.read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_exit_1_names_every_setting_above_the_threshold(default_run, tmp_path, capsys):
    _, report, report_path, _ = default_run
    over_zero = [s["name"] for s in report["settings"] if s["bem_overhead"] > 0]
    assert over_zero, "BEM does more work than the base in every setting; some overhead must be positive"
    capsys.readouterr()
    code = main(["--from-report", str(report_path), "--max-overhead", "0", "--json", str(tmp_path / "r.json")])
    err = capsys.readouterr().err
    assert code == 1
    for name in over_zero:
        assert name in err
    rechecked = json.loads((tmp_path / "r.json").read_text())
    assert rechecked["failed"] == over_zero and rechecked["passed"] is False
    assert validate_report(rechecked) == []


def test_exit_0_when_the_threshold_is_met(default_run, capsys):
    _, report, report_path, _ = default_run
    highest = max(s["bem_overhead"] for s in report["settings"])
    assert main(["--from-report", str(report_path), "--max-overhead", str(highest + 0.01), "--quiet"]) == 0
    assert "BEM overhead above" not in capsys.readouterr().err


def test_ungated_kinds_never_fail(default_run, tmp_path):
    _, report, _, _ = default_run
    for setting in report["settings"]:
        setting["gated"] = setting["kind"] != "train"
    path = tmp_path / "partial.json"
    from bem.profiling.report import apply_gate

    path.write_text(json.dumps(apply_gate(report, report["max_overhead"])))
    threshold = max(s["bem_overhead"] for s in report["settings"] if s["kind"] != "train") + 0.01
    assert main(["--from-report", str(path), "--max-overhead", str(max(threshold, 0.0)), "--quiet"]) == 0


def _run(args: list[str], cwd: Path = REPO) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.run([sys.executable, *args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120)


def test_profile_py_and_bem_profile_are_the_same_command():
    for command in (["profile.py", "--max-overhead", "-1"], ["-m", "bem", "profile", "--max-overhead", "-1"]):
        result = _run(command)
        assert result.returncode == 2, result.stderr
        assert "--max-overhead" in result.stderr and "0.15 means 15%" in result.stderr


def test_profile_py_does_not_break_the_standard_profile_module():
    # from the repository root, `profile` resolves to profile.py; cProfile must still work
    result = _run(["-c", "import cProfile, profile; cProfile.run('sum(range(10))'); print(profile.Profile)"])
    assert result.returncode == 0, result.stderr
    assert "function calls" in result.stdout


def test_local_model_with_kernels_and_without_lora(tmp_path, capsys):
    from transformers import AutoModelForCausalLM, LlamaConfig

    model_dir = tmp_path / "local_model"
    AutoModelForCausalLM.from_config(LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=4,
        num_key_value_heads=2, pad_token_id=0)).save_pretrained(model_dir)
    config = tmp_path / "small.yaml"
    config.write_text(yaml.safe_dump({
        "name": "small", "lora": False, "prefill": {"shapes": [[1, 8]]}, "decode": {"batch_sizes": []},
        "train": {"enabled": False}, "timing": {"warmup": 0, "repeats": 1},
        "kernels": {"shapes": [[4, 32, 48, 4]], "run_with_profile": True}, "output_dir": str(tmp_path),
    }))
    assert main(["--config", str(config), "--model", str(model_dir), "--max-overhead", "1000", "--quiet"]) == 0
    report = json.loads((tmp_path / "small.json").read_text())
    assert validate_report(report) == []
    assert report["config"]["model"]["path"] == str(model_dir) and report["model"]["bem_modules"] == 7
    assert [s["name"] for s in report["settings"]] == ["prefill b1 s8"]
    assert report["settings"][0]["lora"] is None and report["model"]["lora_note"] == "disabled in the config"
    assert report["kernels"]["passed"] and len(report["kernels"]["accuracy"]) == 1
    assert "kernel micro-benchmark" in capsys.readouterr().out


def test_noise_that_cannot_give_a_decode_time_exits_1(monkeypatch, tmp_path, capsys):
    from bem.profiling import runner

    # every sample 1 ms: generating N tokens looks no slower than generating one
    monkeypatch.setattr(runner, "interleaved",
                        lambda runs, clock, warmup, repeats: {name: [1.0] * repeats for name in runs})
    config = tmp_path / "decode.yaml"
    config.write_text(yaml.safe_dump({"lora": False, "prefill": {"shapes": []}, "decode": {"batch_sizes": [1]},
                                      "train": {"enabled": False}, "output_dir": str(tmp_path)}))
    assert main(["--config", str(config), "--max-overhead", "1000", "--quiet"]) == 1
    assert "measurement failed: decode b1" in capsys.readouterr().err


def test_compiled_decoding_is_a_gated_setting_of_its_own(tmp_path):
    """decode.compiled adds static-cache decoding with generate's compiled step (here with the eager backend,
    which traces the step as compilation does but skips the code generation that takes minutes on a CPU)."""
    config = yaml.safe_load((REPO / "configs" / "profile_tiny.yaml").read_text())
    config.update(prefill={"shapes": []}, train={"enabled": False}, output_dir=str(tmp_path), max_overhead=1000)
    config["decode"].update(batch_sizes=[2], new_tokens=8, compiled=True, compile_backend="eager")
    config["timing"].update(warmup=2, repeats=3)
    path = tmp_path / "compiled.yaml"
    path.write_text(yaml.safe_dump(config))
    assert main(["--config", str(path), "--quiet"]) == 0
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert validate_report(report) == []
    compiled = [s for s in report["settings"] if s["kind"] == "decode_compiled"]
    assert [s["name"] for s in compiled] == ["decode (compiled) b2"] and compiled[0]["gated"]
    assert all(compiled[0][key] > 0 for key in ("base", "bem", "lora"))
