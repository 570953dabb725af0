"""The JSON report's schema (version 2, documented in docs/profiling.md) and a validator for it.

A schema node is a type or tuple of types (None allowed), a dict of required keys, a one-element
list (a list of such items) or `MapOf(node)` (a mapping with any string keys).
"""

from __future__ import annotations

from typing import Any

NoneType = type(None)
Number = (int, float)


class MapOf:
    def __init__(self, node: Any) -> None:
        self.node = node


MEMORY = {"saved_for_backward_bytes": int, "peak_step_bytes": (int, NoneType)}

INTERVAL = {"low": (*Number, NoneType), "high": (*Number, NoneType)}  # null: unbounded at that end

SETTING = {
    "name": str,
    "kind": str,  # prefill | decode | decode_compiled | train
    "shape": MapOf(int),
    "unit": str,  # ms | ms/token
    "base": Number,
    "bem": Number,
    "lora": (*Number, NoneType),
    "bem_overhead": (*Number, NoneType),  # null when the timings give no ratio (see problem)
    "lora_overhead": (*Number, NoneType),
    "bem_vs_lora": (*Number, NoneType),
    "intervals": MapOf(INTERVAL),  # bem_overhead, and lora_overhead / bem_vs_lora with LoRA
    "repeats": int,
    "stop_reason": str,  # target_spread | max_repeats | max_seconds
    "seconds": Number,
    "problem": (str, NoneType),
    "samples_ms": MapOf([Number]),
    "memory": (MapOf(MEMORY), NoneType),
    "gated": bool,
    "verdict": str,  # pass | fail | undecided | ungated
    "verdict_reason": str,
}

ROUTING = {
    "setting": str,
    "call": str,  # forward (prefill) | step (decode)
    "controller_ms": Number,
    "samples": [Number],
    "share_of_bem": Number,
    "fraction_of_base": Number,
}

KERNEL_ROW = {
    "shape": MapOf(int),
    "dtype": str,
    "backend": str,
    "dispatch_ms": Number,
    "pytorch_ms": Number,
    "speedup": Number,
    "bytes": int,
    "dispatch_gbps": Number,
    "pytorch_gbps": Number,
    "dispatch_pct_of_copy": Number,
    "pytorch_pct_of_copy": Number,
}

ACCURACY_ROW = {
    "shape": MapOf(int),
    "dtype": str,
    "max_abs_error": (*Number, NoneType),  # null when the output holds NaN or inf
    "relative_error": (*Number, NoneType),
    "pytorch_relative_error": Number,
    "tolerance": Number,
    "passed": bool,
}

KERNELS = {
    "device": str,
    "kernels_available": bool,
    "copy_gbps": Number,
    "matmul_tflops": (*Number, NoneType),
    "benchmarks": [KERNEL_ROW],
    "accuracy": [ACCURACY_ROW],
    "passed": bool,
    "fused_bench": (dict, NoneType),  # bem.kernels.bench results on a GPU with the extension, else null
}

REPORT = {
    "kind": str,
    "schema_version": int,
    "name": str,
    "created_unix": Number,
    "duration_s": Number,
    "config": dict,
    "environment": {
        "python": str, "torch": str, "transformers": str, "peft": (str, NoneType), "device": str,
        "device_name": str, "threads": int, "dtype": str, "attn_implementation": str, "kernels_available": bool,
    },
    "model": {
        "model_type": str, "parameters": int, "bem_modules": int, "bem_trainable_parameters": int,
        "lora_trainable_parameters": (int, NoneType), "lora_note": (str, NoneType), "routing": bool,
    },
    "timing": {"method": str, "statistic": str, "interval": str, "confidence": Number, "warmup": int,
               "min_repeats": int, "max_repeats": int, "target_spread": Number, "max_seconds": Number,
               "interleaved": bool, "gpu_warmup_seconds": Number},
    "settings": [SETTING],
    "routing": [ROUTING],
    "kernels": (KERNELS, NoneType),
    "max_overhead": Number,
    "failed": [str],
    "undecided": [str],
    "verdict": str,  # pass | fail | undecided
    "passed": bool,
}


SWEEP_CONFIG = {
    "name": str,
    "config_path": str,
    "report_path": (str, NoneType),
    "verdict": str,  # pass | fail | undecided | error
    "error": (str, NoneType),
    "max_overhead": Number,
    "failed": [str],
    "undecided": [str],
}

SWEEP_ROW = {
    "config": str,
    "setting": str,
    "kind": str,
    "unit": str,
    "base": Number,
    "bem": Number,
    "lora": (*Number, NoneType),
    "bem_overhead": (*Number, NoneType),
    "interval": (INTERVAL, NoneType),
    "repeats": int,
    "verdict": str,
    "verdict_reason": str,
}

SWEEP_SUMMARY = {
    "kind": str,
    "schema_version": int,
    "created_unix": Number,
    "duration_s": Number,
    "configs": [SWEEP_CONFIG],
    "rows": [SWEEP_ROW],
    "verdict": str,  # pass | fail | undecided
}


def validate_report(report: Any) -> list[str]:
    """Every way `report` departs from the schema, as 'path: problem' lines; empty when it conforms."""
    from .report import REPORT_KIND, SCHEMA_VERSION

    if isinstance(report, dict) and report.get("kind") == REPORT_KIND and report.get("schema_version") != SCHEMA_VERSION:
        return [f"report.schema_version: expected {SCHEMA_VERSION}, got {report.get('schema_version')!r}"
                + (" (a report from before intervals; measure again)" if report.get("schema_version") == 1 else "")]
    errors: list[str] = []
    _check(report, REPORT, "report", errors)
    if not errors:
        _check_consistency(report, errors)
    return errors


def validate_sweep_summary(summary: Any) -> list[str]:
    """Every way a `--sweep` summary departs from its schema; empty when it conforms."""
    from .sweep import ERROR, SUMMARY_KIND, SUMMARY_SCHEMA_VERSION, sweep_verdict

    errors: list[str] = []
    _check(summary, SWEEP_SUMMARY, "summary", errors)
    if errors:
        return errors
    if summary["kind"] != SUMMARY_KIND:
        errors.append(f"summary.kind: expected '{SUMMARY_KIND}', got {summary['kind']!r}")
    if summary["schema_version"] != SUMMARY_SCHEMA_VERSION:
        errors.append(f"summary.schema_version: expected {SUMMARY_SCHEMA_VERSION}, got {summary['schema_version']!r}")
    for index, config in enumerate(summary["configs"]):
        if (config["verdict"] == ERROR) != (config["error"] is not None):
            errors.append(f"summary.configs[{index}]: verdict 'error' goes with an error message, and only it")
    expected = sweep_verdict([c["verdict"] for c in summary["configs"]])
    if summary["verdict"] != expected:
        errors.append(f"summary.verdict: expected {expected!r} from the configs' verdicts, got {summary['verdict']!r}")
    return errors


def validate_kernel_report(report: Any) -> list[str]:
    errors: list[str] = []
    _check(report, KERNELS, "kernels", errors)
    return errors


def _type_ok(value: Any, types: tuple) -> bool:
    if isinstance(value, bool):
        return bool in types
    return isinstance(value, types)


def _check(value: Any, node: Any, path: str, errors: list[str]) -> None:
    if isinstance(node, type):
        node = (node,)
    if isinstance(node, tuple):
        plain = tuple(n for n in node if isinstance(n, type))
        nested = [n for n in node if not isinstance(n, type)]  # at most one structured option
        if _type_ok(value, plain):
            return
        if nested and value is not None:
            _check(value, nested[0], path, errors)
            return
        names = " or ".join(t.__name__ for t in plain) + (" or an object" if nested else "")
        errors.append(f"{path}: expected {names}, got {type(value).__name__}")
    elif isinstance(node, dict):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key, child in node.items():
            if key not in value:
                errors.append(f"{path}: missing key '{key}'")
            else:
                _check(value[key], child, f"{path}.{key}", errors)
    elif isinstance(node, list):
        if not isinstance(value, list):
            errors.append(f"{path}: expected a list, got {type(value).__name__}")
            return
        for index, item in enumerate(value):
            _check(item, node[0], f"{path}[{index}]", errors)
    elif isinstance(node, MapOf):
        if not isinstance(value, dict):
            errors.append(f"{path}: expected an object, got {type(value).__name__}")
            return
        for key, item in value.items():
            _check(item, node.node, f"{path}.{key}", errors)
    else:  # pragma: no cover - a malformed schema node is a programming error
        raise TypeError(f"bad schema node at {path}: {node!r}")


def _check_consistency(report: dict, errors: list[str]) -> None:
    """Facts the types cannot say: known kinds and names, intervals in order, the verdicts agree with them."""
    from .config import KINDS
    from .gate import VERDICTS, judge, overall
    from .report import REPORT_KIND
    from .statistics import RATIOS
    from .stopping import STOP_REASONS

    if report["kind"] != REPORT_KIND:
        errors.append(f"report.kind: expected '{REPORT_KIND}', got {report['kind']!r}")
    ratio_keys = {key for key, _, _ in RATIOS}
    for index, setting in enumerate(report["settings"]):
        where = f"report.settings[{index}]"
        if setting["kind"] not in KINDS:
            errors.append(f"{where}.kind: unknown kind {setting['kind']!r}")
        if setting["stop_reason"] not in STOP_REASONS:
            errors.append(f"{where}.stop_reason: expected one of {', '.join(STOP_REASONS)}, got {setting['stop_reason']!r}")
        if setting["verdict"] not in VERDICTS:
            errors.append(f"{where}.verdict: expected one of {', '.join(VERDICTS)}, got {setting['verdict']!r}")
        if setting["problem"] is None and (setting["base"] <= 0 or setting["bem"] <= 0):
            errors.append(f"{where}: times must be positive unless a problem is recorded")
        if setting["problem"] is None and setting["bem_overhead"] is None:
            errors.append(f"{where}.bem_overhead: null without a problem recorded")
        for key, interval in setting["intervals"].items():
            if key not in ratio_keys:
                errors.append(f"{where}.intervals.{key}: unknown ratio (expected {', '.join(sorted(ratio_keys))})")
            elif None not in (interval["low"], interval["high"]) and interval["low"] > interval["high"]:
                errors.append(f"{where}.intervals.{key}: low {interval['low']} above high {interval['high']}")
        if "bem_overhead" not in setting["intervals"]:
            errors.append(f"{where}.intervals: missing 'bem_overhead'")
        if any(len(values) != setting["repeats"] for key, values in setting["samples_ms"].items()):
            errors.append(f"{where}.samples_ms: every workload needs {setting['repeats']} samples (repeats)")
    if errors:
        return
    expected = [judge(setting, report["max_overhead"])[0] for setting in report["settings"]]
    for index, (setting, verdict) in enumerate(zip(report["settings"], expected)):
        if setting["verdict"] != verdict:
            errors.append(f"report.settings[{index}].verdict: {setting['verdict']!r} disagrees with its interval "
                          f"and max_overhead (expected {verdict!r})")
    names = [s["name"] for s in report["settings"]]
    failed = [n for n, v in zip(names, expected) if v == "fail"]
    undecided = [n for n, v in zip(names, expected) if v == "undecided"]
    if failed != report["failed"] or undecided != report["undecided"]:
        errors.append(f"report.failed/undecided disagree with the verdicts: expected failed={failed}, "
                      f"undecided={undecided}")
    verdict = overall(expected)
    if report["verdict"] != verdict or report["passed"] != (verdict == "pass"):
        errors.append(f"report.verdict/passed disagree with the settings: expected verdict={verdict!r}")
