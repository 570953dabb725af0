"""The profile report as terminal tables: settings with their overheads and intervals, the controller's
share, training-step memory, the kernels, and which settings failed or could not be decided."""

from __future__ import annotations

from typing import Any, Optional

from .gate import FAIL, UNDECIDED

VERDICT_LABELS = {"pass": "pass", "fail": "FAIL", "undecided": "undecided", "ungated": "-"}


def pct(value: Optional[float]) -> str:
    return "-" if value is None else f"{100 * value:+.1f}%"


def num(value: Optional[float]) -> str:
    return "-" if value is None else f"{value:.3f}"


def with_interval(point: Optional[float], interval: Optional[dict]) -> str:
    """'+5.8% [+4.9, +6.6]' (percent; 'inf' at an unbounded end)."""
    if interval is None:
        return pct(point)
    low = "-inf" if interval["low"] is None else f"{100 * interval['low']:+.1f}"
    high = "+inf" if interval["high"] is None else f"{100 * interval['high']:+.1f}"
    return f"{pct(point)} [{low}, {high}]"


def with_half_width(point: Optional[float], interval: Optional[dict]) -> str:
    """'+65.8% ±2.1' (half the interval's width, in points; '±inf' when unbounded)."""
    if interval is None:
        return pct(point)
    if interval["low"] is None or interval["high"] is None:
        return f"{pct(point)} ±inf"
    return f"{pct(point)} ±{50 * (interval['high'] - interval['low']):.1f}"


def columns(rows: list[list[str]], left: int = 1) -> list[str]:
    """Left-align the first `left` columns (names), right-align the others, rule under the header."""
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    out = []
    for index, row in enumerate(rows):
        out.append("  ".join(cell.ljust(w) if i < left else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths))))
        if index == 0:
            out.append("  ".join("-" * w for w in widths))
    return out


def format_table(report: dict[str, Any]) -> str:
    header = ["setting", "unit", "base", "bem", "lora", "bem over base [interval]", "lora over base",
              "bem vs lora", "n", "verdict"]
    rows = [header]
    for s in report["settings"]:
        intervals = s["intervals"]
        rows.append([s["name"], s["unit"], num(s["base"]), num(s["bem"]), num(s["lora"]),
                     with_interval(s["bem_overhead"], intervals.get("bem_overhead")),
                     with_half_width(s["lora_overhead"], intervals.get("lora_overhead")),
                     with_half_width(s["bem_vs_lora"], intervals.get("bem_vs_lora")),
                     str(s["repeats"]), VERDICT_LABELS[s["verdict"]]])
    lines = columns(rows)
    if report["routing"]:
        lines += ["", "routing (the controller alone, same inputs as inside BEM):"]
        routing_rows = [["setting", "call", "controller ms", "share of bem", "of base"]]
        routing_rows += [[r["setting"], r["call"], num(r["controller_ms"]), f"{100 * r['share_of_bem']:.1f}%",
                          f"{100 * r['fraction_of_base']:.1f}%"] for r in report["routing"]]
        lines += columns(routing_rows)
    memory_rows = [["setting", "variant", "saved for backward MiB", "peak step MiB"]]
    for s in report["settings"]:
        for variant, values in (s["memory"] or {}).items():
            peak = values["peak_step_bytes"]
            memory_rows.append([s["name"], variant, f"{values['saved_for_backward_bytes'] / 2**20:.1f}",
                                "-" if peak is None else f"{peak / 2**20:.1f}"])
    if len(memory_rows) > 1:
        lines += ["", "training-step memory:"] + columns(memory_rows)
    if report["kernels"] is not None:
        from .kernels import format_kernel_table

        lines += ["", "kernel micro-benchmark:", format_kernel_table(report["kernels"])]
    lines += ["", footer(report)]
    lines += [f"{VERDICT_LABELS[s['verdict']]}: {s['name']}: {s['verdict_reason']}"
              for s in report["settings"] if s["verdict"] in (FAIL, UNDECIDED)]
    return "\n".join(lines)


def footer(report: dict[str, Any]) -> str:
    env, timing = report["environment"], report["timing"]
    return (f"{env['device_name']} ({env['device']}), {env['dtype']}, {timing['method']}; medians over "
            f"{timing['min_repeats']}-{timing['max_repeats']} interleaved repeats, "
            f"{100 * timing['confidence']:g}% intervals of the per-repeat ratios; gate: BEM over base "
            f"<= {100 * report['max_overhead']:.1f}% beyond the noise; verdict: {report['verdict']}")
