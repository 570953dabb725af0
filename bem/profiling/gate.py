"""The overhead gate: each gated setting passes, fails or stays undecided, judged on its interval.

A setting **fails** only where BEM's overhead is above the threshold beyond the noise (the interval's
lower end above it), **passes** where it is at most the threshold beyond the noise (the upper end at
most it), and is **undecided** otherwise: the interval holds the threshold, is unbounded (too few
repeats for the confidence asked), or the timings could not give an overhead at all.
"""

from __future__ import annotations

from typing import Any, Optional

PASS, FAIL, UNDECIDED, UNGATED = "pass", "fail", "undecided", "ungated"
VERDICTS = (PASS, FAIL, UNDECIDED, UNGATED)


def _pct(value: float) -> str:
    return f"{100 * value:+.1f}%"


def judge(setting: dict[str, Any], max_overhead: float) -> tuple[str, str]:
    """(verdict, why) for one setting of a report."""
    if not setting["gated"]:
        return UNGATED, "not gated"
    interval: Optional[dict] = setting["intervals"].get("bem_overhead")
    low = None if interval is None else interval["low"]
    high = None if interval is None else interval["high"]
    threshold = f"{100 * max_overhead:.1f}%"
    if low is not None and low > max_overhead:
        return FAIL, f"lower end {_pct(low)} above {threshold}"
    if high is not None and high <= max_overhead:
        return PASS, f"upper end {_pct(high)} within {threshold}"
    if setting.get("problem"):
        return UNDECIDED, setting["problem"]
    if low is None or high is None:
        return UNDECIDED, (f"unbounded interval after {setting['repeats']} repeats (too few for the confidence, "
                           f"or repeats without a defined ratio)")
    return UNDECIDED, f"interval [{_pct(low)}, {_pct(high)}] holds the threshold {threshold}"


def overall(verdicts: list[str]) -> str:
    """A run's verdict: fail if any setting failed, else undecided if any was, else pass."""
    if FAIL in verdicts:
        return FAIL
    if UNDECIDED in verdicts:
        return UNDECIDED
    return PASS
