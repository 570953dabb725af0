"""`bem profile` / `python profile.py`: measure BEM's overhead and fail when it is too high.

Exit codes: 0 all gated overheads within --max-overhead (and kernels accurate, where measured), 1 an
overhead above it (the failing settings are named on stderr) or a kernel accuracy failure, 2 bad
arguments or config.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Optional

from .config import DEVICES, ProfileConfig, ProfileConfigError, load_profile_config, profile_config_from_dict
from .timing import MeasurementError

PROG = "bem profile"


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> None:  # argparse prints usage and exits 2; keep that, name the command
        self.print_usage(sys.stderr)
        raise _UsageError(f"{PROG}: error: {message}")


class _UsageError(Exception):
    pass


def _non_negative(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number such as 0.15, got {text!r}") from None
    if not value >= 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"must be a finite number >= 0 (0.15 means 15%), got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog=PROG, description="Latency overhead of BEM over the frozen base model (and PEFT LoRA).")
    parser.add_argument("--config", type=Path, help="YAML profile config (default: the built-in tiny CPU profile, "
                                                    "as in configs/profile_tiny.yaml)")
    parser.add_argument("--max-overhead", type=_non_negative,
                        help="fail (exit 1) when BEM is slower than the base by more than this fraction "
                             "in any gated setting (default: the config's max_overhead, 0.15)")
    parser.add_argument("--model", help="local Hugging Face model directory; replaces the config's model")
    parser.add_argument("--device", choices=DEVICES, help="where to run (default: the config's device)")
    parser.add_argument("--repeats", type=_positive_int, help="timed repeats per setting")
    parser.add_argument("--no-lora", action="store_true", help="skip the PEFT LoRA peer")
    parser.add_argument("--output-dir", type=Path, help="where the JSON report and PNG chart go")
    parser.add_argument("--json", type=Path, help="JSON report path (default: <output-dir>/<name>.json)")
    parser.add_argument("--png", type=Path, help="PNG chart path (default: <output-dir>/<name>.png)")
    parser.add_argument("--kernels", action="store_true",
                        help="run the kernel micro-benchmark and accuracy check instead of the model profile")
    parser.add_argument("--from-report", type=Path, metavar="JSON",
                        help="measure nothing: re-check a saved report against --max-overhead and redraw it")
    parser.add_argument("--quiet", action="store_true", help="print only the table")
    return parser


def resolve_config(args: argparse.Namespace) -> ProfileConfig:
    config = load_profile_config(args.config) if args.config is not None else ProfileConfig()
    data: dict[str, Any] = config.to_dict()
    if args.max_overhead is not None:
        data["max_overhead"] = args.max_overhead
    if args.model is not None:
        data["model"]["path"], data["model"]["config"] = args.model, None
    if args.device is not None:
        data["device"] = args.device
    if args.repeats is not None:
        data["timing"]["repeats"] = args.repeats
    if args.no_lora:
        data["lora"] = False
    if args.output_dir is not None:
        data["output_dir"] = str(args.output_dir)
    return profile_config_from_dict(data, source="arguments")


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
    except _UsageError as err:
        print(err, file=sys.stderr)
        return 2
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    try:
        if args.from_report is not None:
            return _recheck(args)
        config = resolve_config(args)
        if args.kernels:
            return _kernels(args, config)
        return _profile(args, config)
    except ProfileConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return 2
    except MeasurementError as err:  # no trustworthy result: fail rather than pass
        print(f"{PROG}: measurement failed: {err}", file=sys.stderr)
        return 1


def _paths(args: argparse.Namespace, config: ProfileConfig, suffix: str = "") -> tuple[Path, Path]:
    out = Path(config.output_dir)
    return (args.json or out / f"{config.name}{suffix}.json", args.png or out / f"{config.name}{suffix}.png")


def _profile(args: argparse.Namespace, config: ProfileConfig) -> int:
    from .report import write_report
    from .runner import run_profile

    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    report = run_profile(config, log=log)
    json_path, png_path = _paths(args, config)
    return _finish(report, json_path, png_path, write_json=True, log=log, writer=write_report)


def _recheck(args: argparse.Namespace) -> int:
    from .report import apply_gate, read_report, write_report
    from .schema import validate_report

    path = args.from_report
    if not path.is_file():
        raise ProfileConfigError(f"report not found: {path}")
    try:
        report = read_report(path)
    except ValueError as err:
        raise ProfileConfigError(f"{path} is not a JSON report: {err}") from None
    errors = validate_report(report)
    if errors:
        raise ProfileConfigError(f"{path} does not match the report schema: " + "; ".join(errors[:5]))
    threshold = report["max_overhead"] if args.max_overhead is None else args.max_overhead
    report = apply_gate(report, threshold)
    log = (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr))
    return _finish(report, args.json, args.png, write_json=args.json is not None, log=log, writer=write_report)


def _finish(report: dict, json_path: Optional[Path], png_path: Optional[Path], write_json: bool, log, writer) -> int:
    from .report import format_table

    print(format_table(report))
    if write_json and json_path is not None:
        writer(report, json_path)
        log(f"report: {json_path}")
    if png_path is not None:
        try:
            from .chart import write_chart
            write_chart(report, png_path)
            log(f"chart:  {png_path}")
        except ImportError:
            print(f"{PROG}: matplotlib is not installed; no chart written (pip install matplotlib)", file=sys.stderr)
    code = 0
    if report["failed"]:
        by_name = {s["name"]: s for s in report["settings"]}
        details = ", ".join(f"{name} ({100 * by_name[name]['bem_overhead']:+.1f}%)" for name in report["failed"])
        print(f"{PROG}: BEM overhead above {100 * report['max_overhead']:.1f}% in: {details}", file=sys.stderr)
        code = 1
    if report["kernels"] is not None and not report["kernels"]["passed"]:
        print(f"{PROG}: generated_update is less accurate than tolerated (see the kernels section)", file=sys.stderr)
        code = 1
    return code


def _kernels(args: argparse.Namespace, config: ProfileConfig) -> int:
    from ..io_utils import atomic_write_json
    from .kernels import format_kernel_table, run_kernel_benchmark
    from .models import resolve_device

    report = run_kernel_benchmark(config.kernels, resolve_device(config.device), repeats=config.timing.repeats,
                                  seed=config.seed, gpu_warmup_seconds=config.timing.gpu_warmup_seconds)
    print(format_kernel_table(report))
    json_path, _ = _paths(args, config, suffix="_kernels")
    atomic_write_json(json_path, report)
    if not args.quiet:
        print(f"report: {json_path}", file=sys.stderr)
    failed = [row for row in report["accuracy"] if not row["passed"]]
    if failed:
        names = ", ".join("x".join(str(v) for v in row["shape"].values()) for row in failed)
        print(f"{PROG}: generated_update is less accurate than tolerated for shapes: {names}", file=sys.stderr)
        return 1
    return 0
