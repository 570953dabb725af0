"""`bem train` with Python's garbage collections timed: is a collection what stalls some training steps?

    accelerate launch ... scripts/gc_pause_probe.py [--unfrozen] --gc-out DIR CONFIG [overrides...]

Each process records every collection (generation, ms, objects collected) that starts inside the training
loop and writes them to DIR/gc_rank<R>.json at exit; process 0 prints a line per generation. `bem train`
freezes everything alive at the loop's start out of the collector's walks (`frozen_collector` in
bem/training/trainer.py); --unfrozen turns that off, to measure what it saves.
"""

from __future__ import annotations

import contextlib
import gc
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the checkout's bem, installed or not

def main() -> int:
    args = sys.argv[1:]
    unfrozen = "--unfrozen" in args
    args = [a for a in args if a != "--unfrozen"]
    index = args.index("--gc-out")
    out = Path(args[index + 1])
    del args[index:index + 2]

    pauses: list[dict] = []
    began: dict[str, float] = {}
    loop = {"start": None, "end": None}

    def record(phase: str, info: dict) -> None:
        if phase == "start":
            began["t"] = time.perf_counter()
        elif loop["start"] is not None and loop["end"] is None and "t" in began:
            pauses.append({"generation": info["generation"], "ms": 1e3 * (time.perf_counter() - began["t"]),
                           "collected": info["collected"]})

    gc.callbacks.append(record)
    from bem.training import trainer as trainer_module

    inner = contextlib.nullcontext if unfrozen else trainer_module.frozen_collector

    @contextlib.contextmanager
    def timed_collector():  # the loop's window opens after the trainer's own collect-and-freeze
        with inner():
            loop["start"] = time.perf_counter()
            try:
                yield
            finally:
                loop["end"] = time.perf_counter()

    trainer_module.frozen_collector = timed_collector
    from bem.cli import main as bem_main

    code = bem_main(["train", *args])
    rank = int(os.environ.get("RANK", "0"))
    out.mkdir(parents=True, exist_ok=True)
    seconds = (loop["end"] or time.perf_counter()) - (loop["start"] or time.perf_counter())
    (out / f"gc_rank{rank}.json").write_text(json.dumps({"frozen_by_the_trainer": not unfrozen, "loop_s": seconds,
                                                         "pauses": pauses}))
    by_generation: dict[int, list[float]] = {}
    for pause in pauses:
        by_generation.setdefault(pause["generation"], []).append(pause["ms"])
    for generation, times in sorted(by_generation.items()):
        print(f"rank {rank}{' unfrozen' if unfrozen else ''}: generation {generation}: {len(times)} collections, "
              f"{sum(times):.1f} ms in all, longest {max(times):.1f} ms, loop {seconds:.1f} s", flush=True)
    if not pauses:
        print(f"rank {rank}{' unfrozen' if unfrozen else ''}: no collection in the {seconds:.1f} s loop", flush=True)
    return code


if __name__ == "__main__":
    sys.exit(main())
