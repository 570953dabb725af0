"""`--sweep`: profile several shape families one after another in one process, and summarise them.

    python profile.py --sweep                        # every config of SWEEP
    python profile.py --sweep smollm_135m,gpt2       # by name: configs/profile_<name>.yaml (or a YAML path)

Each config writes its own report as it finishes; the summary (one row per config and setting) is
written last. A config that cannot be run (out of memory, say) is recorded with its error and the
sweep goes on with the next.
"""

from __future__ import annotations

import gc
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Optional

import torch

from .config import ProfileConfig, ProfileConfigError
from .gate import FAIL, PASS, UNDECIDED
from .table import VERDICT_LABELS, columns, num, with_interval

# smallest first, so a broken setup shows up early
SWEEP = ("smollm_135m", "gpt2", "qwen2_1.5b", "llama_1b", "phi3_mini", "llama3_8b")
SUMMARY_KIND = "bem-profile-sweep"
SUMMARY_SCHEMA_VERSION = 1
ERROR = "error"
CONFIG_DIRS = (Path("configs"), Path(__file__).resolve().parents[2] / "configs")  # the working directory's first


@dataclass
class SweepEntry:
    name: str  # as asked for on the command line
    path: Path
    config: ProfileConfig


def sweep_names(spec: str) -> list[str]:
    """'all' -> SWEEP; 'a,b,c' -> ['a', 'b', 'c']."""
    if spec == "all":
        return list(SWEEP)
    names = [part.strip() for part in spec.split(",")]
    if not all(names):
        raise ProfileConfigError(f"--sweep expects comma-separated config names such as 'gpt2,llama_1b', got {spec!r}")
    if len(set(names)) != len(names):
        raise ProfileConfigError(f"--sweep names a config twice: {spec!r}")
    return names


def known_names() -> list[str]:
    found = {path.stem[len("profile_"):] for folder in CONFIG_DIRS if folder.is_dir()
             for path in folder.glob("profile_*.yaml")}
    return sorted(found)


def config_path(name: str) -> Path:
    """A YAML path as given, or configs/profile_<name>.yaml in the working directory or the repository."""
    if name.endswith((".yaml", ".yml")) or "/" in name:
        path = Path(name)
        if not path.is_file():
            raise ProfileConfigError(f"--sweep: config file not found: {path}")
        return path
    for folder in CONFIG_DIRS:
        candidate = folder / f"profile_{name}.yaml"
        if candidate.is_file():
            return candidate
    from ..config import closest_name

    known = known_names()
    raise ProfileConfigError(f"--sweep: no profile config named '{name}'{closest_name(name, known)}; "
                             f"known: {', '.join(known) or 'none found'}")


def free_device_memory() -> None:
    """Between configs: drop the last models, their cached allocations and compiled graphs."""
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    try:
        torch._dynamo.reset()  # compiled decoding steps of the last config's models
    except AttributeError:  # pragma: no cover - torch without dynamo
        pass


Measure = Callable[[ProfileConfig], dict]
Keep = Callable[[SweepEntry, dict], Optional[Path]]  # writes one config's report, returns its path


def run_sweep(entries: list[SweepEntry], measure: Measure, keep: Keep, log: Callable[[str], None]) -> dict[str, Any]:
    """Measure every entry in turn, keep each report as it comes, and return the summary."""
    started = time.time()
    configs, rows = [], []
    for position, entry in enumerate(entries, 1):
        log(f"[{position}/{len(entries)}] {entry.name} ({entry.path})")
        record: dict[str, Any] = {"name": entry.config.name, "config_path": str(entry.path), "report_path": None,
                                  "verdict": ERROR, "error": None, "max_overhead": entry.config.max_overhead,
                                  "failed": [], "undecided": []}
        try:
            report = measure(entry.config)
        except (KeyboardInterrupt, ProfileConfigError):
            raise
        except Exception as err:  # noqa: BLE001 - one config's failure is recorded; the others still run
            record["error"] = f"{type(err).__name__}: {err}"
            log(f"  {entry.name} could not be measured: {record['error']}")
        else:
            path = keep(entry, report)
            record.update(report_path=None if path is None else str(path), verdict=report["verdict"],
                          failed=list(report["failed"]), undecided=list(report["undecided"]))
            rows += [summary_row(report["name"], setting) for setting in report["settings"]]
        finally:
            free_device_memory()
        configs.append(record)
    return {"kind": SUMMARY_KIND, "schema_version": SUMMARY_SCHEMA_VERSION, "created_unix": started,
            "duration_s": time.time() - started, "configs": configs, "rows": rows,
            "verdict": sweep_verdict([c["verdict"] for c in configs])}


def summary_row(config_name: str, setting: dict[str, Any]) -> dict[str, Any]:
    return {"config": config_name, "setting": setting["name"], "kind": setting["kind"], "unit": setting["unit"],
            "base": setting["base"], "bem": setting["bem"], "lora": setting["lora"],
            "bem_overhead": setting["bem_overhead"], "interval": setting["intervals"].get("bem_overhead"),
            "repeats": setting["repeats"], "verdict": setting["verdict"], "verdict_reason": setting["verdict_reason"]}


def sweep_verdict(verdicts: list[str]) -> str:
    """fail if any config failed; undecided if any was, or could not be measured; else pass."""
    if FAIL in verdicts:
        return FAIL
    if UNDECIDED in verdicts or ERROR in verdicts:
        return UNDECIDED
    return PASS


def format_sweep_table(summary: dict[str, Any]) -> str:
    rows = [["config", "setting", "unit", "base", "bem", "lora", "bem over base [interval]", "n", "verdict"]]
    for row in summary["rows"]:
        rows.append([row["config"], row["setting"], row["unit"], num(row["base"]), num(row["bem"]), num(row["lora"]),
                     with_interval(row["bem_overhead"], row["interval"]), str(row["repeats"]),
                     VERDICT_LABELS[row["verdict"]]])
    lines = columns(rows, left=2)
    for config in summary["configs"]:
        if config["error"] is not None:
            lines.append(f"error: {config['name']}: {config['error']}")
    for row in summary["rows"]:
        if row["verdict"] in (FAIL, UNDECIDED):
            lines.append(f"{VERDICT_LABELS[row['verdict']]}: {row['config']} {row['setting']}: {row['verdict_reason']}")
    count = len(summary["configs"])
    lines.append(f"sweep verdict: {summary['verdict']} ({count} config{'s' * (count != 1)}, "
                 f"{sum(c['error'] is not None for c in summary['configs'])} not measured)")
    return "\n".join(lines)
