"""`bem profile` end to end on a trimmed tiny CPU profile, and its exit codes: 0 pass, 1 fail, 2 bad
config, 3 undecided."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import yaml

from bem.profiling.cli import main
from bem.profiling.schema import validate_report
from test_profile_report import BASE, setting, synthetic_report

REPO = Path(__file__).resolve().parents[1]
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def _small_profile(tmp_path: Path, compiled: bool = False, **changes) -> Path:
    """The tiny profile cut to one setting of each kind (compiled decoding, if asked, with the eager backend,
    which traces the step as compilation does but skips the code generation that takes minutes on a CPU)."""
    config = yaml.safe_load((REPO / "configs" / "profile_tiny.yaml").read_text())
    config.update(prefill={"shapes": [[1, 16]]}, output_dir=str(tmp_path), max_overhead=1000)
    config["model"]["config"]["num_hidden_layers"] = 1
    config["decode"].update(batch_sizes=[1], prompt_length=4, new_tokens=6, compiled=compiled,
                            compile_backend="eager")
    config["train"].update(batch_size=1, sequence_length=16)
    config["timing"].update(warmup=1, min_repeats=5, max_repeats=5)
    config.update(changes)
    path = tmp_path / "small.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.fixture(scope="module")
def small_run(tmp_path_factory):
    out = tmp_path_factory.mktemp("profile")
    code = main(["--config", str(_small_profile(out)), "--quiet"])
    report_path, chart_path = out / "tiny.json", out / "tiny.png"
    return code, json.loads(report_path.read_text()), report_path, chart_path


def test_profile_writes_a_report_matching_its_schema(small_run):
    code, report, report_path, _ = small_run
    assert validate_report(report) == []
    assert report["verdict"] != "fail"  # nothing is 1000x slower
    assert code == {"pass": 0, "undecided": 3}[report["verdict"]]  # undecided only where this machine was too noisy
    assert [s["kind"] for s in report["settings"]] == ["prefill", "decode", "train"]
    assert all(s["gated"] for s in report["settings"])
    assert report["model"]["bem_modules"] == 7  # 1 layer x 7 projections
    assert all(s["lora"] is not None for s in report["settings"])
    assert [r["call"] for r in report["routing"] if r["setting"] == "prefill b1 s16"] == ["forward"]
    for s in report["settings"]:
        assert s["repeats"] == 5 and s["stop_reason"] in ("target_spread", "max_repeats")
        assert all(len(samples) == 5 for samples in s["samples_ms"].values())
        assert set(s["intervals"]) == {"bem_overhead", "lora_overhead", "bem_vs_lora"}
    decode = report["settings"][1]
    assert set(decode["samples_ms"]) == {"base", "bem", "lora"}  # each repeat: one generate's median step
    train = report["settings"][-1]
    assert set(train["memory"]) == {"base", "bem", "lora"}
    assert all(m["saved_for_backward_bytes"] > 0 for m in train["memory"].values())
    assert report["timing"]["min_repeats"] == report["timing"]["max_repeats"] == 5
    assert not list(report_path.parent.glob(".*.tmp"))  # the atomic write left no temp file


def test_chart_is_a_non_empty_png(small_run):
    data = small_run[3].read_bytes()
    assert data.startswith(PNG_MAGIC) and len(data) > 1000


def test_from_report_re_gates_a_measured_report(small_run, tmp_path):
    _, report, report_path, _ = small_run
    decided = [s for s in report["settings"] if s["intervals"]["bem_overhead"]["high"] is not None]
    if not decided:
        pytest.skip("this machine was too noisy to bound any interval in five repeats")
    lowest = min(s["intervals"]["bem_overhead"]["low"] for s in decided)
    out = tmp_path / "r.json"
    code = main(["--from-report", str(report_path), "--max-overhead", str(max(lowest - 0.01, 0.0)), "--quiet",
                 "--json", str(out)])
    rechecked = json.loads(out.read_text())
    assert validate_report(rechecked) == [] and rechecked["failed"] and code == 1


def _write(tmp_path: Path, report: dict) -> Path:
    path = tmp_path / "report.json"
    path.write_text(json.dumps(report))
    return path


def test_exit_codes_follow_the_verdict(tmp_path, capsys):
    report = synthetic_report([
        setting("prefill b1 s8", "prefill", BASE, [b * 1.05 for b in BASE]),
        setting("decode b1", "decode", BASE, [b * (1.0 + 0.05 * i) for i, b in enumerate(BASE)], unit="ms/token"),
    ])
    path = _write(tmp_path, report)
    assert main(["--from-report", str(path), "--max-overhead", "0.15", "--quiet"]) == 3  # 0..30% holds 15%
    err = capsys.readouterr().err
    assert "could not decide" in err and "decode b1: interval [+0.0%, +30.0%] holds the threshold" in err
    assert main(["--from-report", str(path), "--max-overhead", "0.31", "--quiet"]) == 0
    assert "could not decide" not in capsys.readouterr().err
    assert main(["--from-report", str(path), "--max-overhead", "0.01", "--quiet"]) == 1  # +5% fails, beyond the noise
    err = capsys.readouterr().err
    assert "above 1.0% beyond the noise in: prefill b1 s8 (+5.0% [+5.0, +5.0])" in err
    assert "could not decide" in err  # decode b1 [0, 30%] holds 1% too: named, while the exit says failed


def test_from_report_writes_the_re_gated_report(tmp_path):
    path = _write(tmp_path, synthetic_report([setting("prefill b1 s8", "prefill", BASE, [b * 1.2 for b in BASE])]))
    out = tmp_path / "out.json"
    assert main(["--from-report", str(path), "--max-overhead", "0.25", "--quiet", "--json", str(out)]) == 0
    rechecked = json.loads(out.read_text())
    assert rechecked["max_overhead"] == 0.25 and rechecked["verdict"] == "pass" and validate_report(rechecked) == []


def test_a_schema_1_report_is_refused_with_the_reason(tmp_path, capsys):
    old = {"kind": "bem-profile", "schema_version": 1, "settings": [], "max_overhead": 0.15, "failed": [], "passed": True}
    assert main(["--from-report", str(_write(tmp_path, old)), "--quiet"]) == 2
    assert "expected 2, got 1 (a report from before intervals; measure again)" in capsys.readouterr().err


def test_ungated_kinds_never_fail(tmp_path):
    report = synthetic_report([setting("prefill b1 s8", "prefill", BASE, [b * 1.05 for b in BASE]),
                               setting("train b1 s8", "train", BASE, [b * 3 for b in BASE], gated=False)])
    assert main(["--from-report", str(_write(tmp_path, report)), "--max-overhead", "0.1", "--quiet"]) == 0


def test_a_decode_repeat_is_the_median_of_its_steps(monkeypatch):
    """One generate gives one sample: the median gap between the moments successive steps' logits come out."""
    from bem.profiling import workloads

    marks = iter([10.0, 10.004, 10.007, 10.009, 10.100, 10.103])  # gaps 4, 3, 2, 91, 3 ms

    class Model(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def generate(self, input_ids, logits_processor, max_new_tokens, **_):
            for _ in range(max_new_tokens):
                logits_processor(input_ids, torch.zeros(1, 4))

    monkeypatch.setattr(workloads.time, "perf_counter", lambda: next(marks))
    run = workloads.decoding_steps(Model(), [torch.zeros(1, 2, dtype=torch.long)], 6, 0)
    assert run.self_timed and run(0) == pytest.approx(3.0)


def test_each_setting_logs_its_ratio_as_it_is_measured(monkeypatch, tmp_path, capsys):
    """A run cut off before its report is written still leaves each finished setting's ratio in the log."""
    from bem.profiling import runner

    def timed(runs, clock, warmup, rule, spread_of):  # BEM 10% slower than the base in every repeat
        value = {"base": 2.0, "bem": 2.2, "lora": 3.0}
        return {name: [value.get(name, 0.5)] * 5 for name in runs}, "max_repeats"

    monkeypatch.setattr(runner, "interleaved_until", timed)
    path = _small_profile(tmp_path, train={"enabled": False})
    main(["--config", str(path)])
    err = capsys.readouterr().err
    assert "5 repeats (max_repeats, " in err
    # prefill, and decoding's per-step samples: 2.2 / 2.0
    assert err.count("s): BEM over base +10.0% [+10.0, +10.0]") == 2


def test_compiled_decoding_is_a_gated_setting_of_its_own(tmp_path):
    """decode.compiled adds static-cache decoding with generate's compiled step (LoRA left out: tracing
    each model's step is what takes the time here)."""
    path = _small_profile(tmp_path, compiled=True, lora=False, prefill={"shapes": []}, train={"enabled": False})
    assert main(["--config", str(path), "--quiet"]) in (0, 3)
    report = json.loads((tmp_path / "tiny.json").read_text())
    assert validate_report(report) == []
    compiled = [s for s in report["settings"] if s["kind"] == "decode_compiled"]
    assert [s["name"] for s in compiled] == ["decode (compiled) b1"] and compiled[0]["gated"]
    assert compiled[0]["verdict"] in ("pass", "undecided") and compiled[0]["repeats"] == 5


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
        "train": {"enabled": False}, "timing": {"warmup": 0, "min_repeats": 5, "max_repeats": 5},
        "kernels": {"shapes": [[4, 32, 48, 4]], "run_with_profile": True}, "output_dir": str(tmp_path),
    }))
    assert main(["--config", str(config), "--model", str(model_dir), "--max-overhead", "1000", "--quiet"]) in (0, 3)
    report = json.loads((tmp_path / "small.json").read_text())
    assert validate_report(report) == []
    assert report["config"]["model"]["path"] == str(model_dir) and report["model"]["bem_modules"] == 7
    assert [s["name"] for s in report["settings"]] == ["prefill b1 s8"]
    assert report["settings"][0]["lora"] is None and report["model"]["lora_note"] == "disabled in the config"
    assert set(report["settings"][0]["intervals"]) == {"bem_overhead"}
    assert report["kernels"]["passed"] and len(report["kernels"]["accuracy"]) == 1
    assert "kernel micro-benchmark" in capsys.readouterr().out
