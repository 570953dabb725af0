"""PNG chart of the overhead per setting: BEM and LoRA over the base, with the gate drawn as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from ..io_utils import atomic_write


def write_chart(report: dict[str, Any], path: Union[str, Path]) -> None:
    """Draw the report's overheads into `path` (PNG, written atomically). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt

    settings = report["settings"]
    names = [s["name"] for s in settings]
    bem = [100 * s["bem_overhead"] for s in settings]
    lora = [None if s["lora_overhead"] is None else 100 * s["lora_overhead"] for s in settings]
    has_lora = any(v is not None for v in lora)
    width = 0.38 if has_lora else 0.6
    positions = list(range(len(names)))

    figure, axes = plt.subplots(figsize=(max(6.0, 1.3 * len(names) + 2), 4.5))
    try:
        offset = width / 2 if has_lora else 0.0
        bars = axes.bar([p - offset for p in positions], bem, width, label="BEM", color="#2b6cb0")
        for bar, setting in zip(bars, settings):
            if setting["gated"] and not setting["passed"]:
                bar.set_color("#c53030")
        if has_lora:
            axes.bar([p + offset for p in positions], [0.0 if v is None else v for v in lora], width,
                     label="PEFT LoRA", color="#a0aec0")
        axes.axhline(100 * report["max_overhead"], color="#c53030", linestyle="--", linewidth=1,
                     label=f"gate {100 * report['max_overhead']:.0f}%")
        axes.axhline(0.0, color="black", linewidth=0.6)
        axes.set_xticks(positions)
        axes.set_xticklabels(names, rotation=20, ha="right")
        axes.set_ylabel("overhead over the frozen base (%)")
        env = report["environment"]
        axes.set_title(f"{report['name']}: {report['model']['model_type']} on {env['device_name']}, {env['dtype']}")
        axes.legend(loc="best")
        figure.tight_layout()
        atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    finally:
        plt.close(figure)
