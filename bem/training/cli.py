"""`bem train CONFIG.yaml [key=value ...]` and `bem generate`: argument parsing, messages, exit codes.

Exit codes: 0 success, 1 a failure while running, 2 a usage or config error (reported before any model
is loaded), 130 interrupted.
"""

from __future__ import annotations

import argparse
import sys
from typing import Callable, Sequence, Union

EXIT_OK, EXIT_FAILURE, EXIT_USAGE, EXIT_INTERRUPTED = 0, 1, 2, 130


def _train_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bem train",
        description="Fine-tune a model with BEM from a YAML config (see docs/training.md). "
                    "Run on several processes with: accelerate launch -m bem train CONFIG.yaml",
        epilog="example: bem train configs/tiny.yaml training.max_steps=50 training.lr=3e-4",
    )
    parser.add_argument("config", help="training config (YAML)")
    parser.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                        help="override a config value, e.g. training.lr=3e-4 (the value is read as YAML)")
    parser.add_argument("--print-config", action="store_true",
                        help="print the checked config with overrides and defaults applied, then exit")
    parser.add_argument("--check", action="store_true",
                        help="check the config (keys, types, paths) and exit without training")
    return parser


def _generate_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="bem generate",
        description="Generate text with a saved BEM adapter on its base model.",
        epilog="example: bem generate runs/tiny/adapter --prompt $'Q: What colour is a lime?\\nA:'",
    )
    parser.add_argument("adapter", help="adapter directory written by training (adapter_config.json + weights)")
    parser.add_argument("--base", help="base model directory (default: the one recorded in the adapter config)")
    parser.add_argument("--prompt", action="append", required=True,
                        help="prompt text; repeat the option for several prompts")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 (default) decodes greedily")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda, cuda:1 ... (default: cuda if available)")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                        help="base model dtype (default: as saved)")
    return parser


def _parse(parser: argparse.ArgumentParser, argv: Sequence[str]) -> Union[argparse.Namespace, int]:
    """The parsed arguments, or the exit code when argparse already answered (--help, usage error)."""
    try:
        # intermixed: options may come after the KEY=VALUE overrides
        return parser.parse_intermixed_args(list(argv))
    except SystemExit as exit_:
        return EXIT_USAGE if exit_.code else EXIT_OK


def _error(prog: str, message: str) -> None:
    print(f"{prog}: error: {message}", file=sys.stderr)


def train_main(argv: list[str]) -> int:
    args = _parse(_train_parser(), argv)
    if isinstance(args, int):
        return args
    from .config import load_train_config
    from .schema import ConfigError

    try:
        config = load_train_config(args.config, args.overrides)
        if args.print_config:
            print(config.to_yaml(), end="")
            return EXIT_OK
        from .trainer import resolve_resume

        resolve_resume(config)
        if args.check:
            print(f"{args.config}: ok")
            return EXIT_OK
    except ConfigError as err:
        _error("bem train", f"config: {err}")
        return EXIT_USAGE
    return _run("bem train", lambda: _train(config))


def _train(config) -> int:
    from .schema import ConfigError
    from .trainer import train

    try:
        result = train(config)
    except ConfigError as err:
        _error("bem train", f"config: {err}")
        return EXIT_USAGE
    if result.adapter_dir is not None and result.is_main:
        print(f"done: {result.step} steps, last loss {result.last_loss:.4f}"
              + (f", eval loss {result.eval_loss:.4f}" if result.eval_loss is not None else ""))
    return EXIT_OK


def generate_main(argv: list[str]) -> int:
    args = _parse(_generate_parser(), argv)
    if isinstance(args, int):
        return args
    if args.max_new_tokens < 1:
        _error("bem generate", f"--max-new-tokens must be >= 1, got {args.max_new_tokens}")
        return EXIT_USAGE
    if args.temperature < 0 or not 0 < args.top_p <= 1:
        _error("bem generate", "--temperature must be >= 0 and --top-p in (0, 1]")
        return EXIT_USAGE
    from .generate import GenerateError, generate_texts

    def run() -> int:
        try:
            texts = generate_texts(args.adapter, args.prompt, base=args.base, max_new_tokens=args.max_new_tokens,
                                   temperature=args.temperature, top_p=args.top_p, seed=args.seed,
                                   device=args.device, dtype=args.dtype)
        except GenerateError as err:
            _error("bem generate", str(err))
            return EXIT_USAGE
        for prompt, text in zip(args.prompt, texts):
            print(prompt + text)
        return EXIT_OK

    return _run("bem generate", run)


def _run(prog: str, body: Callable[[], int]) -> int:
    try:
        return body()
    except KeyboardInterrupt:
        _error(prog, "interrupted")
        return EXIT_INTERRUPTED
    except (OSError, RuntimeError, ValueError) as err:
        _error(prog, f"{type(err).__name__}: {err}")
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(train_main(sys.argv[1:]))
