"""Where the host's time goes, by Python function, in every thread (the autograd engine's device thread runs
the backward's Python): a thread wakes every `interval` seconds and records each other thread's stack.

    with StackSampler() as sampler:
        ...                      # the steps to look at
    sampler.report(top=25)       # self and inclusive shares of the samples, by function

Samples land where the GIL is released or the switch interval ends, so a C++ call that holds the GIL is counted
at the Python line that made it. The shares are of samples taken, not of wall time.
"""

from __future__ import annotations

import collections
import sys
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Optional


def _where(frame: FrameType) -> str:
    code = frame.f_code
    path = Path(code.co_filename)
    parts = path.parts
    short = "/".join(parts[parts.index("site-packages") + 1:]) if "site-packages" in parts else "/".join(parts[-3:])
    return f"{short}:{code.co_firstlineno} {code.co_qualname}"


class StackSampler:
    def __init__(self, interval: float = 0.0005, thread: Optional[int] = None) -> None:
        self.interval = interval
        self.thread = thread  # sample only this thread (an ident), or every other thread
        self.self_counts: collections.Counter[str] = collections.Counter()
        self.inclusive: collections.Counter[str] = collections.Counter()
        self.samples = 0
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._switch = sys.getswitchinterval()

    def _run(self) -> None:
        me = threading.get_ident()
        while not self._stop.is_set():
            for ident, frame in sys._current_frames().items():
                if ident == me or frame is None or (self.thread is not None and ident != self.thread):
                    continue
                seen = set()
                leaf = _where(frame)
                self.self_counts[leaf] += 1
                while frame is not None:
                    name = _where(frame)
                    if name not in seen:
                        self.inclusive[name] += 1
                        seen.add(name)
                    frame = frame.f_back
                self.samples += 1
            time.sleep(self.interval)

    def __enter__(self) -> "StackSampler":
        sys.setswitchinterval(self.interval)
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        sys.setswitchinterval(self._switch)

    def report(self, top: int = 25, label: str = "") -> None:
        total = max(self.samples, 1)
        print(f"  [{label}] {self.samples} stack samples; by self share:")
        for name, count in self.self_counts.most_common(top):
            print(f"     {100 * count / total:5.1f}%  {name[:120]}")
        print(f"  [{label}] by inclusive share:")
        for name, count in self.inclusive.most_common(top):
            print(f"     {100 * count / total:5.1f}%  {name[:120]}")
