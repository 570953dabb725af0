"""`bem profile` / `python profile.py`: measure BEM's overhead and fail when it is too high beyond the noise.

Exit codes:
  0  every gated setting passed (its interval's upper end within --max-overhead), and the kernels are
     accurate where measured
  1  some gated setting failed (its interval's lower end above the threshold; stderr names each), or a
     kernel accuracy failure
  2  bad arguments or config
  3  nothing failed, but some gated setting could not be decided (its interval holds the threshold, is
     unbounded, or the timings gave no overhead); with --sweep also a config that could not be measured
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any, Callable, Optional

from .config import DEVICES, ProfileConfig, ProfileConfigError, load_profile_config, profile_config_from_dict

PROG = "bem profile"
EXIT_PASS, EXIT_FAIL, EXIT_BAD_CONFIG, EXIT_UNDECIDED = 0, 1, 2, 3
EXIT_BY_VERDICT = {"pass": EXIT_PASS, "fail": EXIT_FAIL, "undecided": EXIT_UNDECIDED}
Log = Callable[[str], None]


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
    parser.add_argument("--sweep", nargs="?", const="all", metavar="NAMES",
                        help="profile several configs one after another: all of the sweep, or comma-separated "
                             "names (configs/profile_<name>.yaml) or YAML paths; one report each and a summary")
    parser.add_argument("--max-overhead", type=_non_negative,
                        help="fail (exit 1) when BEM is slower than the base by more than this fraction beyond "
                             "the noise in any gated setting (default: the config's max_overhead, 0.15)")
    parser.add_argument("--model", help="local Hugging Face model directory; replaces the config's model")
    parser.add_argument("--device", choices=DEVICES, help="where to run (default: the config's device)")
    parser.add_argument("--repeats", type=_positive_int,
                        help="a fixed number of timed repeats per setting (sets timing.min_repeats and max_repeats)")
    parser.add_argument("--no-lora", action="store_true", help="skip the PEFT LoRA peer")
    parser.add_argument("--output-dir", type=Path, help="where the JSON report and PNG chart go")
    parser.add_argument("--json", type=Path, help="JSON report path (default: <output-dir>/<name>.json; "
                                                  "with --sweep the summary's, default <output-dir>/sweep.json)")
    parser.add_argument("--png", type=Path, help="PNG chart path (default: <output-dir>/<name>.png)")
    parser.add_argument("--kernels", action="store_true",
                        help="run the kernel micro-benchmark and accuracy check instead of the model profile")
    parser.add_argument("--from-report", type=Path, metavar="JSON",
                        help="measure nothing: re-check a saved report against --max-overhead and redraw it")
    parser.add_argument("--quiet", action="store_true", help="print only the table")
    return parser


def apply_overrides(config: ProfileConfig, args: argparse.Namespace) -> ProfileConfig:
    """The config with the command line's overrides, validated again."""
    data: dict[str, Any] = config.to_dict()
    if args.max_overhead is not None:
        data["max_overhead"] = args.max_overhead
    if getattr(args, "model", None) is not None:
        data["model"]["path"], data["model"]["config"] = args.model, None
    if args.device is not None:
        data["device"] = args.device
    if args.repeats is not None:
        data["timing"]["min_repeats"] = data["timing"]["max_repeats"] = args.repeats
    if args.no_lora:
        data["lora"] = False
    if args.output_dir is not None:
        data["output_dir"] = str(args.output_dir)
    return profile_config_from_dict(data, source="arguments")


def resolve_config(args: argparse.Namespace) -> ProfileConfig:
    config = load_profile_config(args.config) if args.config is not None else ProfileConfig()
    return apply_overrides(config, args)


def main(argv: Optional[list[str]] = None) -> int:
    try:
        args = build_parser().parse_args(sys.argv[1:] if argv is None else list(argv))
        _check_combinations(args)
    except _UsageError as err:
        print(err, file=sys.stderr)
        return EXIT_BAD_CONFIG
    except SystemExit as exit_:  # --help
        return int(exit_.code or 0)
    try:
        if args.from_report is not None:
            return _recheck(args)
        if args.sweep is not None:
            return _sweep(args)
        config = resolve_config(args)
        if args.kernels:
            return _kernels(args, config)
        return _profile(args, config)
    except ProfileConfigError as err:
        print(f"{PROG}: error: {err}", file=sys.stderr)
        return EXIT_BAD_CONFIG


def _check_combinations(args: argparse.Namespace) -> None:
    if args.sweep is not None:
        clashing = [flag for flag, value in (("--config", args.config), ("--model", args.model),
                                             ("--kernels", args.kernels), ("--from-report", args.from_report),
                                             ("--png", args.png)) if value]
        if clashing:
            raise _UsageError(f"{PROG}: error: --sweep runs the named configs; it does not take {', '.join(clashing)}")


def _log(args: argparse.Namespace) -> Log:
    return (lambda _: None) if args.quiet else (lambda line: print(line, file=sys.stderr))


def _paths(config: ProfileConfig, json: Optional[Path] = None, png: Optional[Path] = None,
           suffix: str = "") -> tuple[Path, Path]:
    """The report's and chart's paths: as given, else <output_dir>/<name><suffix>.json / .png."""
    out = Path(config.output_dir)
    return json or out / f"{config.name}{suffix}.json", png or out / f"{config.name}{suffix}.png"


def _profile(args: argparse.Namespace, config: ProfileConfig) -> int:
    from .runner import run_profile

    log = _log(args)
    report = run_profile(config, log=log)
    json_path, png_path = _paths(config, args.json, args.png)
    return _finish(report, json_path, png_path, log=log)


def _recheck(args: argparse.Namespace) -> int:
    from .report import apply_gate, read_report
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
    return _finish(report, args.json, args.png, log=_log(args))


def write_outputs(report: dict, json_path: Optional[Path], png_path: Optional[Path], log: Log) -> None:
    from .report import write_report

    if json_path is not None:
        write_report(report, json_path)
        log(f"report: {json_path}")
    if png_path is not None:
        try:
            from .chart import write_chart
            write_chart(report, png_path)
            log(f"chart:  {png_path}")
        except ImportError:
            print(f"{PROG}: matplotlib is not installed; no chart written (pip install matplotlib)", file=sys.stderr)


def _finish(report: dict, json_path: Optional[Path], png_path: Optional[Path], log: Log) -> int:
    from .table import format_table

    print(format_table(report))
    write_outputs(report, json_path, png_path, log)
    by_name = {s["name"]: s for s in report["settings"]}
    if report["failed"]:
        details = ", ".join(f"{name} ({_overhead(by_name[name])})" for name in report["failed"])
        print(f"{PROG}: BEM overhead above {100 * report['max_overhead']:.1f}% beyond the noise in: {details}",
              file=sys.stderr)
    if report["undecided"]:
        details = "; ".join(f"{name}: {by_name[name]['verdict_reason']}" for name in report["undecided"])
        print(f"{PROG}: could not decide (exit {EXIT_UNDECIDED} unless something failed): {details}", file=sys.stderr)
    code = EXIT_BY_VERDICT[report["verdict"]]
    if report["kernels"] is not None and not report["kernels"]["passed"]:
        print(f"{PROG}: generated_update is less accurate than tolerated (see the kernels section)", file=sys.stderr)
        code = EXIT_FAIL
    return code


def _overhead(setting: dict) -> str:
    from .table import with_interval

    return with_interval(setting["bem_overhead"], setting["intervals"].get("bem_overhead"))


def _sweep(args: argparse.Namespace) -> int:
    from ..io_utils import atomic_write_json
    from .runner import run_profile
    from .sweep import SweepEntry, config_path, format_sweep_table, run_sweep, sweep_names

    entries = []
    for name in sweep_names(args.sweep):  # every config is read and checked before anything is measured
        path = config_path(name)
        entries.append(SweepEntry(name, path, apply_overrides(load_profile_config(path), args)))
    names = [entry.config.name for entry in entries]
    if len(set(names)) != len(names):
        raise ProfileConfigError(f"--sweep: two configs share a name, so their reports would overwrite: {names}")
    log = _log(args)

    def keep(entry: SweepEntry, report: dict) -> Path:
        from .table import format_table

        json_path, png_path = _paths(entry.config)
        if not args.quiet:
            print(format_table(report), file=sys.stderr)
        write_outputs(report, json_path, png_path, log)
        return json_path

    summary = run_sweep(entries, lambda config: run_profile(config, log=log), keep, log)
    print(format_sweep_table(summary))
    summary_path = args.json or (args.output_dir or Path(entries[0].config.output_dir)) / "sweep.json"
    atomic_write_json(summary_path, summary)
    log(f"summary: {summary_path}")
    return EXIT_BY_VERDICT[summary["verdict"]]


def _kernels(args: argparse.Namespace, config: ProfileConfig) -> int:
    from ..io_utils import atomic_write_json
    from .kernels import format_kernel_table, run_kernel_benchmark
    from .models import resolve_device

    report = run_kernel_benchmark(config.kernels, resolve_device(config.device), repeats=config.timing.min_repeats,
                                  seed=config.seed, gpu_warmup_seconds=config.timing.gpu_warmup_seconds)
    print(format_kernel_table(report))
    json_path, _ = _paths(config, args.json, suffix="_kernels")
    atomic_write_json(json_path, report)
    if not args.quiet:
        print(f"report: {json_path}", file=sys.stderr)
    failed = [row for row in report["accuracy"] if not row["passed"]]
    if failed:
        names = ", ".join("x".join(str(v) for v in row["shape"].values()) for row in failed)
        print(f"{PROG}: generated_update is less accurate than tolerated for shapes: {names}", file=sys.stderr)
        return EXIT_FAIL
    return EXIT_PASS
