"""The report schema validator, the overhead gate and the interleaved timer."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import torch

from bem.profiling import schema
from bem.profiling.report import apply_gate, format_table, make_setting
from bem.profiling.schema import validate_report
from bem.profiling.timing import Clock, interleaved

DOCS = Path(__file__).resolve().parents[1] / "docs" / "profiling.md"


def _report() -> dict:
    settings = [
        make_setting("prefill b1 s8", "prefill", {"batch": 1, "sequence": 8}, "ms",
                     {"base": 10.0, "bem": 11.0, "lora": 12.0}, {"base": [10.0], "bem": [11.0], "lora": [12.0]},
                     None, gated=True),
        make_setting("decode b1", "decode", {"batch": 1}, "ms/token", {"base": 2.0, "bem": 3.0},
                     {"base": [2.0], "bem": [3.0]}, None, gated=True),
        make_setting("train b1 s8", "train", {"batch": 1, "sequence": 8}, "ms", {"base": 5.0, "bem": 9.0},
                     {"base": [5.0], "bem": [9.0]},
                     {"base": {"saved_for_backward_bytes": 10, "peak_step_bytes": None},
                      "bem": {"saved_for_backward_bytes": 12, "peak_step_bytes": None}}, gated=False),
    ]
    report = {
        "kind": "bem-profile", "schema_version": 1, "name": "t", "created_unix": 0.0, "duration_s": 1.0,
        "config": {}, "environment": {"python": "3", "torch": "2", "transformers": "5", "peft": None,
                                      "device": "cpu", "device_name": "cpu", "threads": 1, "dtype": "float32",
                                      "attn_implementation": "eager", "kernels_available": False},
        "model": {"model_type": "llama", "parameters": 10, "bem_modules": 2, "bem_trainable_parameters": 4,
                  "lora_trainable_parameters": None, "lora_note": "peft is not installed", "routing": True},
        "timing": {"method": "perf_counter", "statistic": "median", "warmup": 0, "repeats": 1,
                   "interleaved": True, "gpu_warmup_seconds": 0.0},
        "settings": settings, "routing": [], "kernels": None, "max_overhead": 0.15, "failed": [], "passed": True,
    }
    return apply_gate(report, 0.15)


def test_gate_fails_only_gated_settings_above_the_threshold():
    report = _report()
    assert report["failed"] == ["decode b1"]  # +50%; prefill is +10%, train (+80%) is not gated
    assert report["passed"] is False
    assert apply_gate(report, 0.6)["failed"] == [] and report["passed"] is True
    assert report["settings"][0]["bem_overhead"] == pytest.approx(0.1)
    assert report["settings"][0]["bem_vs_lora"] == pytest.approx(11 / 12 - 1)


def test_validator_accepts_a_conforming_report_and_the_table_renders():
    report = _report()
    assert validate_report(report) == []
    table = format_table(report)
    assert "decode b1" in table and "FAIL" in table and "+50.0%" in table


@pytest.mark.parametrize("breaks, expected", [
    (lambda r: r.pop("settings"), "report: missing key 'settings'"),
    (lambda r: r["settings"][0].update(bem="fast"), "report.settings[0].bem: expected int or float"),
    (lambda r: r["environment"].update(threads=True), "report.environment.threads: expected int"),
    (lambda r: r.update(failed=[]), "disagree with the overheads"),
    (lambda r: r.update(kind="other"), "report.kind: expected 'bem-profile'"),
    (lambda r: r["settings"][2]["memory"]["bem"].pop("peak_step_bytes"), "missing key 'peak_step_bytes'"),
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
    keys |= set(schema.KERNEL_ROW) | set(schema.ACCURACY_ROW) | set(schema.MEMORY)
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
