"""Where training metrics go: a JSON-lines file, optional TensorBoard, and the console."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Optional

from ..io_utils import atomic_write_text


class MetricsLog:
    """Appends one JSON object per record; on resume, drops records past the checkpoint's step."""

    def __init__(self, path: Optional[Path], tensorboard_dir: Optional[Path], resume_step: Optional[int]) -> None:
        self.path = path
        if path is not None and path.is_file():
            if resume_step is None:
                path.unlink()
            else:
                kept = [line for line in path.read_text().splitlines()
                        if line.strip() and json.loads(line).get("step", 0) <= resume_step]
                atomic_write_text(path, "".join(line + "\n" for line in kept))
        self.writer = None
        if tensorboard_dir is not None:
            from torch.utils.tensorboard import SummaryWriter

            self.writer = SummaryWriter(str(tensorboard_dir))

    def write(self, record: dict[str, Any]) -> None:
        if self.path is not None:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            with self.path.open("a", encoding="utf-8") as handle:
                handle.write(json.dumps(record, sort_keys=True) + "\n")
        if self.writer is not None:
            step = record.get("step", 0)
            for key, value in record.items():
                if key != "step" and isinstance(value, (int, float)) and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)

    def close(self) -> None:
        if self.writer is not None:
            self.writer.close()


def routing_summary(stats: dict[str, Any]) -> dict[str, float]:
    """A few numbers out of `routing_stats()`: gate, code norm, and each level's mean norm over modules."""
    if not stats.get("routing"):
        return {}
    summary = {"routing/gate_mean": stats["gate_mean"], "routing/gate_min": stats["gate_min"],
               "routing/code_norm": stats["code_norm_mean"]}
    modules = list(stats["modules"].values())
    for level in ("prefix_norm", "chunk_norm", "token_norm"):
        values = [m[level] for m in modules
                  if m.get(level) is not None and (level != "token_norm" or m.get("token_routed"))]
        if values:
            summary[f"routing/{level}"] = sum(values) / len(values)
    return summary


def format_summary(values: dict[str, float]) -> str:
    return "  ".join(f"{key.split('/')[-1]}={value:.4g}" for key, value in values.items())
