"""The profile report: one record per setting, the overhead gate applied to it, the JSON file.

Times are medians over the repeats of each variant's per-repeat value; overheads are medians of the
per-repeat ratios, with their intervals (`statistics`). `apply_gate` judges every setting (`gate`).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional, Union

from ..io_utils import atomic_write_json
from .gate import FAIL, UNDECIDED, judge, overall
from .statistics import as_dicts, summarise_ratios
from .timing import median

REPORT_KIND = "bem-profile"
SCHEMA_VERSION = 2
VARIANTS = ("base", "bem", "lora")


def make_setting(name: str, kind: str, shape: dict[str, int], unit: str, per_repeat: dict[str, list[float]],
                 samples: dict[str, list[float]], memory: Optional[dict[str, dict]], gated: bool,
                 confidence: float, stop_reason: str, seconds: float,
                 problem: Optional[str] = None) -> dict[str, Any]:
    """One measured setting from each variant's value per repeat (`per_repeat`: base, bem, optionally lora;
    ms per call, or per token for decoding). Overheads are ratios minus one (0.15 = 15% slower)."""
    ratios = summarise_ratios(per_repeat, confidence)
    times = {key: median(per_repeat[key]) if key in per_repeat else None for key in VARIANTS}
    return {
        "name": name,
        "kind": kind,
        "shape": dict(shape),
        "unit": unit,
        **times,
        **{key: ratios[key].point if key in ratios else None
           for key in ("bem_overhead", "lora_overhead", "bem_vs_lora")},
        "intervals": as_dicts(ratios),
        "repeats": len(per_repeat["base"]),
        "stop_reason": stop_reason,
        "seconds": seconds,
        "problem": problem,
        "samples_ms": {key: list(values) for key, values in samples.items() if key != "controller"},
        "memory": memory,
        "gated": gated,
        "verdict": UNDECIDED,  # apply_gate decides
        "verdict_reason": "not judged yet",
    }


def apply_gate(report: dict[str, Any], max_overhead: float) -> dict[str, Any]:
    """Judge every setting at `max_overhead`; fills each `verdict` and the report's `failed`, `undecided`,
    `verdict` and `passed` (true only when every gated setting passed)."""
    for setting in report["settings"]:
        setting["verdict"], setting["verdict_reason"] = judge(setting, max_overhead)
    verdicts = [s["verdict"] for s in report["settings"]]
    report["max_overhead"] = max_overhead
    report["failed"] = [s["name"] for s in report["settings"] if s["verdict"] == FAIL]
    report["undecided"] = [s["name"] for s in report["settings"] if s["verdict"] == UNDECIDED]
    report["verdict"] = overall(verdicts)
    report["passed"] = report["verdict"] == "pass"
    return report


def write_report(report: dict[str, Any], path: Union[str, Path]) -> None:
    atomic_write_json(path, report)


def read_report(path: Union[str, Path]) -> dict[str, Any]:
    return json.loads(Path(path).read_text())
