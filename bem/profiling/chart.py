"""PNG chart of the overhead per setting: BEM and LoRA over the base with their intervals as error bars
(hatched where an interval is unbounded), BEM's bar coloured by its verdict, the gate drawn as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from ..io_utils import atomic_write

BEM, FAIL, UNDECIDED, LORA = "#2b6cb0", "#c53030", "#dd6b20", "#a0aec0"
COLOR_BY_VERDICT = {"fail": FAIL, "undecided": UNDECIDED}


def _bar_and_error(point, interval) -> tuple[float, list[float], bool]:
    """Bar height (%), its [below, above] error in points, and whether the interval is unbounded (then no
    error bar: the bar is hatched instead)."""
    value = 0.0 if point is None else 100 * point
    if interval is None:
        return value, [0.0, 0.0], False
    if interval["low"] is None or interval["high"] is None:
        return value, [0.0, 0.0], True
    return value, [max(0.0, value - 100 * interval["low"]), max(0.0, 100 * interval["high"] - value)], False


def _bars(axes, positions, bars, width, colors) -> None:
    containers = axes.bar(positions, [v for v, _, _ in bars], width, color=colors,
                          yerr=list(zip(*[e for _, e, _ in bars])), capsize=3)
    for patch, (_, _, unbounded) in zip(containers.patches, bars):
        if unbounded:
            patch.set_hatch("//")


def write_chart(report: dict[str, Any], path: Union[str, Path]) -> None:
    """Draw the report's overheads into `path` (PNG, written atomically). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    settings = report["settings"]
    names = [s["name"] for s in settings]
    bem = [_bar_and_error(s["bem_overhead"], s["intervals"].get("bem_overhead")) for s in settings]
    lora = [_bar_and_error(s["lora_overhead"], s["intervals"].get("lora_overhead")) for s in settings]
    has_lora = any(s["lora_overhead"] is not None for s in settings)
    width = 0.38 if has_lora else 0.6
    positions = list(range(len(names)))

    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.5))
    try:
        offset = width / 2 if has_lora else 0.0
        colors = [COLOR_BY_VERDICT.get(s["verdict"], BEM) for s in settings]
        _bars(axes, [p - offset for p in positions], bem, width, colors)
        labels = {BEM: "BEM", FAIL: "BEM, above the gate beyond the noise", UNDECIDED: "BEM, undecided"}
        handles = [Patch(color=color, label=label) for color, label in labels.items() if color in colors]
        if has_lora:
            _bars(axes, [p + offset for p in positions], lora, width, [LORA] * len(lora))
            handles.append(Patch(color=LORA, label="PEFT LoRA"))
        if any(unbounded for _, _, unbounded in bem + lora):
            handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="interval unbounded"))
        handles.append(axes.axhline(100 * report["max_overhead"], color=FAIL, linestyle="--", linewidth=1,
                                    label=f"gate {100 * report['max_overhead']:.0f}%"))
        axes.axhline(0.0, color="black", linewidth=0.6)
        axes.set_xticks(positions)
        axes.set_xticklabels(names, rotation=20, ha="right")
        axes.set_ylabel(f"overhead over the frozen base (%), {100 * report['timing']['confidence']:g}% intervals")
        env = report["environment"]
        axes.set_title(f"{report['name']}: {report['model']['model_type']} on {env['device_name']}, {env['dtype']}")
        axes.legend(handles=handles, loc="best")
        figure.tight_layout()
        atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    finally:
        plt.close(figure)
