"""The profile report: one record per setting, the overhead gate, the terminal table, the JSON file."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from ..io_utils import atomic_write_json

REPORT_KIND = "bem-profile"
SCHEMA_VERSION = 1
VARIANTS = ("base", "bem", "lora")


def make_setting(name: str, kind: str, shape: dict[str, int], unit: str, medians: dict[str, float],
                 samples: dict[str, list[float]], memory: Optional[dict[str, dict]], gated: bool) -> dict[str, Any]:
    """One measured setting. Overheads are ratios to the base minus one (0.15 = 15% slower)."""
    base = medians["base"]
    lora = medians.get("lora")
    return {
        "name": name,
        "kind": kind,
        "shape": dict(shape),
        "unit": unit,
        "base": base,
        "bem": medians["bem"],
        "lora": lora,
        "bem_overhead": medians["bem"] / base - 1.0,
        "lora_overhead": None if lora is None else lora / base - 1.0,
        "bem_vs_lora": None if lora is None else medians["bem"] / lora - 1.0,
        "samples_ms": {key: list(values) for key, values in samples.items() if key != "controller"},
        "memory": memory,
        "gated": gated,
        "passed": True,
    }


def apply_gate(report: dict[str, Any], max_overhead: float) -> dict[str, Any]:
    """Mark each gated setting passed or failed at `max_overhead`; fills `failed` and `passed`."""
    failed = []
    for setting in report["settings"]:
        setting["passed"] = not (setting["gated"] and setting["bem_overhead"] > max_overhead)
        if not setting["passed"]:
            failed.append(setting["name"])
    report["max_overhead"] = max_overhead
    report["failed"] = failed
    report["passed"] = not failed
    return report


def write_report(report: dict[str, Any], path: Union[str, Path]) -> None:
    atomic_write_json(path, report)


def read_report(path: Union[str, Path]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())


# ---------------------------------------------------------------------- terminal table
def _pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def _num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def format_table(report: dict[str, Any]) -> str:
    header = ["setting", "unit", "base", "bem", "lora", "bem over base", "lora over base", "bem vs lora", "gate"]
    rows = [header]
    for s in report["settings"]:
        gate = "-" if not s["gated"] else ("ok" if s["passed"] else "FAIL")
        rows.append([s["name"], s["unit"], _num(s["base"]), _num(s["bem"]), _num(s["lora"]),
                     _pct(s["bem_overhead"]), _pct(s["lora_overhead"]), _pct(s["bem_vs_lora"]), gate])
    lines = _columns(rows)
    if report["routing"]:
        lines += ["", "routing (the controller alone, same inputs as inside BEM):"]
        routing_rows = [["setting", "call", "controller ms", "share of bem", "of base"]]
        routing_rows += [[r["setting"], r["call"], _num(r["controller_ms"]), f"{100 * r['share_of_bem']:.1f}%",
                          f"{100 * r['fraction_of_base']:.1f}%"] for r in report["routing"]]
        lines += _columns(routing_rows)
    memory_rows = [["setting", "variant", "saved for backward MiB", "peak step MiB"]]
    for s in report["settings"]:
        for variant, values in (s["memory"] or {}).items():
            peak = values["peak_step_bytes"]
            memory_rows.append([s["name"], variant, f"{values['saved_for_backward_bytes'] / 2**20:.1f}",
                                "-" if peak is None else f"{peak / 2**20:.1f}"])
    if len(memory_rows) > 1:
        lines += ["", "training-step memory:"] + _columns(memory_rows)
    if report["kernels"] is not None:
        from .kernels import format_kernel_table

        lines += ["", "kernel micro-benchmark:", format_kernel_table(report["kernels"])]
    env = report["environment"]
    lines += ["", f"{env['device_name']} ({env['device']}), {env['dtype']}, {report['timing']['method']} medians of "
              f"{report['timing']['repeats']} interleaved repeats; gate: BEM over base <= "
              f"{100 * report['max_overhead']:.1f}%"]
    if report["failed"]:
        lines.append(f"FAILED: {', '.join(report['failed'])}")
    return "\n".join(lines)


def _columns(rows: list[list[str]]) -> list[str]:
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out
