"""PNG chart of the overhead per setting: BEM and LoRA over the base with their intervals as error bars,
BEM's bar coloured by its verdict, the gate drawn as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from ..io_utils import atomic_write

BEM, FAIL, UNDECIDED, LORA = "#2b6cb0", "#c53030", "#dd6b20", "#a0aec0"
COLOR_BY_VERDICT = {"fail": FAIL, "undecided": UNDECIDED}


def _bar_and_error(point, interval) -> tuple[float, list[float]]:
    """Bar height (%) and its [below, above] error in points; an unbounded end is drawn to the bar."""
    value = 0.0 if point is None else 100 * point
    if interval is None:
        return value, [0.0, 0.0]
    low = value if interval["low"] is None else 100 * interval["low"]
    high = value if interval["high"] is None else 100 * interval["high"]
    return value, [max(0.0, value - low), max(0.0, high - value)]


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
        axes.bar([p - offset for p in positions], [v for v, _ in bem], width, color=colors,
                 yerr=list(zip(*[e for _, e in bem])), capsize=3)
        handles = [Patch(color=BEM, label="BEM")]
        if FAIL in colors:
            handles.append(Patch(color=FAIL, label="BEM, above the gate beyond the noise"))
        if UNDECIDED in colors:
            handles.append(Patch(color=UNDECIDED, label="BEM, undecided"))
        if has_lora:
            axes.bar([p + offset for p in positions], [v for v, _ in lora], width, color=LORA,
                     yerr=list(zip(*[e for _, e in lora])), capsize=3)
            handles.append(Patch(color=LORA, label="PEFT LoRA"))
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
