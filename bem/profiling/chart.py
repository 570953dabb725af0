"""PNG chart of the overhead per setting: BEM and LoRA over the base, with the gate drawn as a line."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Union

from ..io_utils import atomic_write

BEM, FAIL, LORA = "#2b6cb0", "#c53030", "#a0aec0"


def write_chart(report: dict[str, Any], path: Union[str, Path]) -> None:
    """Draw the report's overheads into `path` (PNG, written atomically). Needs matplotlib."""
    import matplotlib

    matplotlib.use("Agg", force=False)
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

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
        colors = [FAIL if s["gated"] and not s["passed"] else BEM for s in settings]
        axes.bar([p - offset for p in positions], bem, width, color=colors)
        handles = [Patch(color=BEM, label="BEM")]
        if FAIL in colors:
            handles.append(Patch(color=FAIL, label="BEM, above the gate"))
        if has_lora:
            axes.bar([p + offset for p in positions], [0.0 if v is None else v for v in lora], width, color=LORA)
            handles.append(Patch(color=LORA, label="PEFT LoRA"))
        handles.append(axes.axhline(100 * report["max_overhead"], color=FAIL, linestyle="--", linewidth=1,
                                    label=f"gate {100 * report['max_overhead']:.0f}%"))
        axes.axhline(0.0, color="black", linewidth=0.6)
        axes.set_xticks(positions)
        axes.set_xticklabels(names, rotation=20, ha="right")
        axes.set_ylabel("overhead over the frozen base (%)")
        env = report["environment"]
        axes.set_title(f"{report['name']}: {report['model']['model_type']} on {env['device_name']}, {env['dtype']}")
        axes.legend(handles=handles, loc="best")
        figure.tight_layout()
        atomic_write(path, lambda tmp: figure.savefig(tmp, format="png", dpi=120))
    finally:
        plt.close(figure)
