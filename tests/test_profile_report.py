"""The report (schema 2): settings built from per-repeat values, the gate's verdicts, the validator, the
table, and the interleaved timer's order."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from bem.profiling import schema
from bem.profiling.report import apply_gate, make_setting
from bem.profiling.schema import validate_report
from bem.profiling.table import format_table
from bem.profiling.timing import Clock, interleaved

DOCS = Path(__file__).resolve().parents[1] / "docs" / "profiling.md"


def setting(name: str, kind: str, base: list[float], bem: list[float], lora=None, gated=True, problem=None,
            unit="ms", memory=None) -> dict:
    """A setting from per-repeat times (the samples are the same values)."""
    per_repeat = {"base": base, "bem": bem, **({"lora": lora} if lora is not None else {})}
    return make_setting(name, kind, {"batch": 1, "sequence": 8}, unit, per_repeat, per_repeat, memory, gated=gated,
                        confidence=0.9, stop_reason="max_repeats", seconds=1.0, problem=problem)


def synthetic_report(settings: list[dict], max_overhead: float = 0.15, name: str = "t") -> dict:
    report = {
        "kind": "bem-profile", "schema_version": 2, "name": name, "created_unix": 0.0, "duration_s": 1.0,
        "config": {}, "environment": {"python": "3", "torch": "2", "transformers": "5", "peft": None,
                                      "device": "cpu", "device_name": "cpu", "threads": 1, "dtype": "float32",
                                      "attn_implementation": "sdpa", "kernels_available": False},
        "model": {"model_type": "llama", "parameters": 10, "bem_modules": 2, "bem_trainable_parameters": 4,
                  "lora_trainable_parameters": None, "lora_note": "peft is not installed", "routing": True},
        "timing": {"method": "perf_counter", "statistic": "median", "interval": "order-statistic",
                   "confidence": 0.9, "warmup": 0, "min_repeats": 5, "max_repeats": 9, "target_spread": 0.01,
                   "max_seconds": 1.0, "interleaved": True, "gpu_warmup_seconds": 0.0},
        "settings": settings, "routing": [], "kernels": None, "max_overhead": max_overhead, "failed": [],
        "undecided": [], "verdict": "undecided", "passed": False,
    }
    return apply_gate(report, max_overhead)


BASE = [10.0, 10.2, 9.9, 10.1, 10.0, 10.3, 9.8]
MEMORY = {"base": {"saved_for_backward_bytes": 10, "peak_step_bytes": None},
          "bem": {"saved_for_backward_bytes": 12, "peak_step_bytes": None}}


def _report() -> dict:
    return synthetic_report([
        setting("prefill b1 s8", "prefill", BASE, [b * 1.05 for b in BASE], lora=[b * 1.5 for b in BASE]),
        setting("decode b1", "decode", BASE, [b * (1.50 + 0.01 * i) for i, b in enumerate(BASE)], unit="ms/token"),
        setting("decode b4", "decode", BASE, [b * (1.0 + 0.05 * i) for i, b in enumerate(BASE)], unit="ms/token"),
        setting("train b1 s8", "train", BASE, [b * 1.8 for b in BASE], gated=False, memory=MEMORY),
    ])


def test_setting_reports_medians_ratios_and_intervals():
    s = _report()["settings"][0]
    assert s["base"] == pytest.approx(10.0) and s["bem"] == pytest.approx(10.5) and s["lora"] == pytest.approx(15.0)
    assert s["bem_overhead"] == pytest.approx(0.05) and s["bem_vs_lora"] == pytest.approx(1.05 / 1.5 - 1)
    assert s["intervals"]["bem_overhead"] == pytest.approx({"low": 0.05, "high": 0.05})
    assert set(s["intervals"]) == {"bem_overhead", "lora_overhead", "bem_vs_lora"} and s["repeats"] == 7


def test_gate_passes_fails_and_leaves_undecided():
    report = _report()
    verdicts = {s["name"]: s["verdict"] for s in report["settings"]}
    # +5% pass; +50..56% fail; 0..30% holds 15%: undecided; training is not gated
    assert verdicts == {"prefill b1 s8": "pass", "decode b1": "fail", "decode b4": "undecided",
                        "train b1 s8": "ungated"}
    assert report["failed"] == ["decode b1"] and report["undecided"] == ["decode b4"]
    assert report["verdict"] == "fail" and report["passed"] is False
    apply_gate(report, 0.6)  # re-gating from the stored intervals
    assert report["failed"] == [] and report["undecided"] == [] and report["verdict"] == "pass" and report["passed"]
    apply_gate(report, 0.2)
    assert report["failed"] == ["decode b1"] and report["undecided"] == ["decode b4"]


def test_a_setting_without_an_overhead_is_undecided_with_its_reason():
    problem = "generating 8 tokens measured no slower than generating one"
    report = synthetic_report([setting("decode b1", "decode", [0.0] * 5, [0.0] * 5, unit="ms/token", problem=problem)])
    s = report["settings"][0]
    assert s["bem_overhead"] is None and s["intervals"]["bem_overhead"] == {"low": None, "high": None}
    assert (s["verdict"], s["verdict_reason"]) == ("undecided", problem)
    assert report["verdict"] == "undecided" and validate_report(report) == []


def test_validator_accepts_a_conforming_report_and_the_table_renders():
    report = _report()
    assert validate_report(report) == []
    table = format_table(report)
    assert "decode b1" in table and "FAIL" in table and "undecided" in table
    assert "+5.0% [+5.0, +5.0]" in table  # BEM over base with its interval
    assert "undecided: decode b4: interval [+0.0%, +30.0%] holds the threshold 15.0%" in table
    assert "verdict: fail" in table


@pytest.mark.parametrize("breaks, expected", [
    (lambda r: r.pop("settings"), "report: missing key 'settings'"),
    (lambda r: r["settings"][0].update(bem="fast"), "report.settings[0].bem: expected int or float"),
    (lambda r: r["environment"].update(threads=True), "report.environment.threads: expected int"),
    (lambda r: r.update(failed=[]), "disagree with the verdicts"),
    (lambda r: r.update(verdict="pass"), "report.verdict/passed disagree"),
    (lambda r: r["settings"][0].update(verdict="fail"), "disagrees with its interval"),
    (lambda r: r["settings"][1]["intervals"]["bem_overhead"].update(low=0.9), "low 0.9 above high"),
    (lambda r: r["settings"][1]["intervals"].pop("bem_overhead"), "missing 'bem_overhead'"),
    (lambda r: r["settings"][1].update(stop_reason="bored"), "stop_reason: expected one of"),
    (lambda r: r["settings"][1].update(repeats=3), "every workload needs 3 samples"),
    (lambda r: r["settings"][1].update(bem_overhead=None), "null without a problem recorded"),
    (lambda r: r.update(kind="other"), "report.kind: expected 'bem-profile'"),
    (lambda r: r.update(schema_version=1), "a report from before intervals"),
    (lambda r: r["settings"][3]["memory"]["bem"].pop("peak_step_bytes"), "missing key 'peak_step_bytes'"),
    (lambda r: r["settings"][1].update(kind="warmup"), "unknown kind 'warmup'"),
])
def test_validator_names_what_is_wrong(breaks, expected):
    report = copy.deepcopy(_report())
    breaks(report)
    errors = validate_report(report)
    assert any(expected in e for e in errors), errors


def test_every_schema_key_is_documented():
    text = DOCS.read_text()
    keys = set(schema.REPORT) | set(schema.SETTING) | set(schema.ROUTING) | set(schema.KERNELS)
    keys |= set(schema.REPORT["environment"]) | set(schema.REPORT["model"]) | set(schema.REPORT["timing"])
    keys |= set(schema.KERNEL_ROW) | set(schema.ACCURACY_ROW) | set(schema.MEMORY) | set(schema.INTERVAL)
    keys |= set(schema.SWEEP_SUMMARY) | set(schema.SWEEP_CONFIG) | set(schema.SWEEP_ROW)
    missing = sorted(k for k in keys if f"`{k}`" not in text)
    assert not missing, f"keys not documented in docs/profiling.md: {missing}"


def test_interleaved_rotates_the_order_and_collects_every_repeat():
    calls: list[tuple[str, int]] = []
    workloads = {name: (lambda index, name=name: calls.append((name, index))) for name in ("a", "b", "c")}
    samples = interleaved(workloads, Clock(torch.device("cpu")), warmup=1, repeats=3)
    assert {k: len(v) for k, v in samples.items()} == {"a": 3, "b": 3, "c": 3}
    assert all(v >= 0 for values in samples.values() for v in values)
    timed = calls[3:]
    assert [n for n, _ in timed] == ["a", "b", "c", "b", "c", "a", "c", "a", "b"]
    assert [i for _, i in timed] == [0, 0, 0, 1, 1, 1, 2, 2, 2]
