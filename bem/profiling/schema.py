"""The JSON report's schema (version 1, documented in docs/profiling.md) and a validator for it.

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

SETTING = {
    "name": str,
    "kind": str,  # prefill | decode | decode_compiled | train
    "shape": MapOf(int),
    "unit": str,  # ms | ms/token
    "base": Number,
    "bem": Number,
    "lora": (*Number, NoneType),
    "bem_overhead": Number,
    "lora_overhead": (*Number, NoneType),
    "bem_vs_lora": (*Number, NoneType),
    "samples_ms": MapOf([Number]),
    "memory": (MapOf(MEMORY), NoneType),
    "gated": bool,
    "passed": bool,
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
    "timing": {"method": str, "statistic": str, "warmup": int, "repeats": int, "interleaved": bool,
               "gpu_warmup_seconds": Number},
    "settings": [SETTING],
    "routing": [ROUTING],
    "kernels": (KERNELS, NoneType),
    "max_overhead": Number,
    "failed": [str],
    "passed": bool,
}


def validate_report(report: Any) -> list[str]:
    """Every way `report` departs from the schema, as 'path: problem' lines; empty when it conforms."""
    errors: list[str] = []
    _check(report, REPORT, "report", errors)
    if not errors:
        _check_consistency(report, errors)
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
    """Facts the types cannot say: known kinds, the gate agrees with the numbers."""
    from .config import KINDS
    from .report import REPORT_KIND, SCHEMA_VERSION

    if report["kind"] != REPORT_KIND:
        errors.append(f"report.kind: expected '{REPORT_KIND}', got {report['kind']!r}")
    if report["schema_version"] != SCHEMA_VERSION:
        errors.append(f"report.schema_version: expected {SCHEMA_VERSION}, got {report['schema_version']!r}")
    failed = []
    for index, setting in enumerate(report["settings"]):
        if setting["kind"] not in KINDS:
            errors.append(f"report.settings[{index}].kind: unknown kind {setting['kind']!r}")
        if setting["base"] <= 0 or setting["bem"] <= 0:
            errors.append(f"report.settings[{index}]: times must be positive")
        if setting["gated"] and setting["bem_overhead"] > report["max_overhead"]:
            failed.append(setting["name"])
    if failed != report["failed"] or report["passed"] != (not failed):
        errors.append(f"report.failed/passed disagree with the overheads: expected failed={failed}")
