"""`bem` command line: one entry point, one subcommand per job, each implemented in its own module."""

from __future__ import annotations

import sys
from typing import Optional, Sequence

COMMANDS = {
    "train": ("bem.training.cli", "train_main", "fine-tune a model with BEM from a YAML config"),
    "generate": ("bem.training.cli", "generate_main", "generate text with a saved BEM adapter"),
    "profile": ("bem.profiling.cli", "main", "profile BEM's latency overhead against the frozen model"),
}


def _usage() -> str:
    lines = ["usage: bem <command> [options]", "", "commands:"]
    lines += [f"  {name:<10} {help_text}" for name, (_, _, help_text) in COMMANDS.items()]
    lines += ["", "Run 'bem <command> --help' for a command's options."]
    return "\n".join(lines)


def main(argv: Optional[Sequence[str]] = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    if not args or args[0] in {"-h", "--help"}:
        print(_usage())
        return 0 if args else 2
    name, rest = args[0], args[1:]
    if name not in COMMANDS:
        from .config import closest_name

        print(f"bem: unknown command '{name}'{closest_name(name, COMMANDS)}\n\n{_usage()}", file=sys.stderr)
        return 2
    module_name, function_name, _ = COMMANDS[name]
    import importlib

    function = getattr(importlib.import_module(module_name), function_name)
    return int(function(rest) or 0)


if __name__ == "__main__":
    sys.exit(main())
