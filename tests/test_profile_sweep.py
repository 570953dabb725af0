"""`--sweep`: config names, one report per config and a summary, the sweep's verdict and exit code
(measuring replaced by synthetic reports: what is tested here is the bookkeeping)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from bem.profiling import runner
from bem.profiling.cli import main
from bem.profiling.config import ProfileConfigError
from bem.profiling.schema import validate_report, validate_sweep_summary
from bem.profiling.sweep import SWEEP, config_path, sweep_names, sweep_verdict
from test_profile_report import BASE, setting, synthetic_report

REPO = Path(__file__).resolve().parents[1]


def test_sweep_names():
    assert sweep_names("all") == list(SWEEP)
    assert sweep_names("gpt2, llama_1b") == ["gpt2", "llama_1b"]
    with pytest.raises(ProfileConfigError, match="comma-separated config names"):
        sweep_names("gpt2,,llama_1b")
    with pytest.raises(ProfileConfigError, match="names a config twice"):
        sweep_names("gpt2,gpt2")


def test_config_names_resolve_to_files_or_say_what_exists(tmp_path):
    assert config_path("gpt2").name == "profile_gpt2.yaml"
    own = tmp_path / "mine.yaml"
    own.write_text("name: mine\n")
    assert config_path(str(own)) == own
    with pytest.raises(ProfileConfigError, match=r"no profile config named 'gtp2' \(did you mean 'gpt2'\?\); known: .*llama_1b"):
        config_path("gtp2")
    with pytest.raises(ProfileConfigError, match="config file not found"):
        config_path(str(tmp_path / "absent.yaml"))


@pytest.mark.parametrize("verdicts, expected", [
    (["pass", "pass"], "pass"), (["pass", "undecided"], "undecided"), (["error", "pass"], "undecided"),
    (["undecided", "fail", "error"], "fail"),
])
def test_sweep_verdict(verdicts, expected):
    assert sweep_verdict(verdicts) == expected


def _fake_measure(outcomes: dict, calls: list):
    """run_profile stand-in: per config name a BEM/base factor for every repeat, or an exception to raise."""
    def run_profile(config, log=print):
        calls.append(config.name)
        outcome = outcomes[config.name]
        if isinstance(outcome, Exception):
            raise outcome
        bem = [b * f for b, f in zip(BASE, outcome)]
        return synthetic_report([setting("prefill b1 s1024", "prefill", BASE, bem, lora=[b * 1.6 for b in BASE])],
                                max_overhead=config.max_overhead, name=config.name)
    return run_profile


def _sweep(monkeypatch, tmp_path, outcomes: dict, extra=()):
    calls: list[str] = []
    monkeypatch.setattr(runner, "run_profile", _fake_measure(outcomes, calls))
    code = main(["--sweep", ",".join(outcomes), "--output-dir", str(tmp_path), "--quiet", *extra])
    summary = json.loads((tmp_path / "sweep.json").read_text())
    return code, summary, calls


def test_sweep_runs_each_config_in_turn_and_writes_every_report(monkeypatch, tmp_path, capsys):
    code, summary, calls = _sweep(monkeypatch, tmp_path, {"smollm_135m": [1.05] * 7, "gpt2": [1.02] * 7})
    assert code == 0 and calls == ["smollm_135m", "gpt2"]
    assert validate_sweep_summary(summary) == [] and summary["verdict"] == "pass"
    assert [c["name"] for c in summary["configs"]] == ["smollm_135m", "gpt2"]
    for config in summary["configs"]:
        report = json.loads(Path(config["report_path"]).read_text())
        assert validate_report(report) == [] and report["name"] == config["name"]
        assert Path(config["report_path"]).with_suffix(".png").is_file()
    assert [(r["config"], r["setting"], r["verdict"]) for r in summary["rows"]] == [
        ("smollm_135m", "prefill b1 s1024", "pass"), ("gpt2", "prefill b1 s1024", "pass")]
    table = capsys.readouterr().out
    assert "smollm_135m  prefill b1 s1024" in table and "+5.0% [+5.0, +5.0]" in table
    assert "sweep verdict: pass (2 configs, 0 not measured)" in table


def test_one_failure_fails_the_sweep(monkeypatch, tmp_path, capsys):
    code, summary, _ = _sweep(monkeypatch, tmp_path, {"gpt2": [1.3] * 7, "llama_1b": [1.0 + 0.05 * i for i in range(7)]})
    assert code == 1 and summary["verdict"] == "fail"
    assert [c["verdict"] for c in summary["configs"]] == ["fail", "undecided"]
    table = capsys.readouterr().out
    assert "undecided: llama_1b prefill b1 s1024: interval [+0.0%, +30.0%] holds the threshold 15.0%" in table


def test_a_config_that_cannot_run_is_recorded_and_the_sweep_goes_on(monkeypatch, tmp_path, capsys):
    outcomes = {"phi3_mini": RuntimeError("CUDA out of memory"), "gpt2": [1.01] * 7}
    code, summary, calls = _sweep(monkeypatch, tmp_path, outcomes)
    assert code == 3 and calls == ["phi3_mini", "gpt2"]  # not measured: no verdict, so undecided
    assert validate_sweep_summary(summary) == []
    first = summary["configs"][0]
    assert (first["verdict"], first["error"], first["report_path"]) == ("error", "RuntimeError: CUDA out of memory", None)
    assert "error: phi3_mini: RuntimeError: CUDA out of memory" in capsys.readouterr().out


def test_overrides_apply_to_every_config(monkeypatch, tmp_path):
    code, summary, _ = _sweep(monkeypatch, tmp_path, {"gpt2": [1.3] * 7, "qwen2_1.5b": [1.3] * 7},
                              extra=["--max-overhead", "0.5", "--json", str(tmp_path / "sweep.json")])
    assert code == 0 and [c["max_overhead"] for c in summary["configs"]] == [0.5, 0.5]


@pytest.mark.parametrize("argv, expected", [
    (["--sweep", "gpt2", "--config", "configs/profile_gpt2.yaml"], "it does not take --config"),
    (["--sweep", "--kernels"], "it does not take --kernels"),
    (["--sweep", "gpt2,nope"], "no profile config named 'nope'"),
    (["--sweep", "gpt2", "--repeats", "2"], "timing.max_repeats must be at least 5"),
])
def test_bad_sweeps_exit_2_before_measuring(monkeypatch, capsys, argv, expected):
    monkeypatch.setattr(runner, "run_profile", lambda *a, **k: pytest.fail("measured despite a bad sweep"))
    assert main(argv) == 2
    assert expected in capsys.readouterr().err
