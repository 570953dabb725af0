"""The profiler's noise: a distribution-free confidence interval for the median per-repeat ratio.

Each repeat times every variant back to back, so one repeat gives one ratio per pair of variants
(`bem_i / base_i - 1`). Drift between repeats (clocks, a busy neighbour) moves both times of a repeat
alike and cancels in its ratio. The overhead reported is the median of those per-repeat ratios, and its
interval is the order-statistic confidence interval for a median: with the n ratios sorted,
`[x_(k), x_(n-k+1)]` holds the true median with probability `1 - 2 P(Binomial(n, 1/2) <= k - 1)`, for
any distribution of independent ratios. No resampling, no normality assumption, the same answer every
time. `k` is the largest rank whose coverage still reaches the confidence asked for; when even
`[min, max]` falls short (fewer than 5 repeats at 90%) the interval is unbounded.

A repeat whose ratio is undefined (a non-positive time, as a noisy decode per-token difference can be)
counts against both ends: as -inf for the lower end and +inf for the upper end.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass
from typing import Any, Optional, Sequence

# (report key, numerator variant, denominator variant)
RATIOS = (("bem_overhead", "bem", "base"), ("lora_overhead", "lora", "base"), ("bem_vs_lora", "bem", "lora"))


@dataclass(frozen=True)
class Interval:
    """A confidence interval; None at an end means unbounded there."""

    low: Optional[float]
    high: Optional[float]

    @property
    def bounded(self) -> bool:
        return self.low is not None and self.high is not None

    @property
    def half_width(self) -> float:
        """Half the interval's width (inf when unbounded): the spread the stopping rule compares."""
        return (self.high - self.low) / 2 if self.bounded else math.inf

    def to_dict(self) -> dict[str, Optional[float]]:
        return {"low": self.low, "high": self.high}


UNBOUNDED = Interval(None, None)


def coverage(n: int, k: int) -> float:
    """Probability that `[x_(k), x_(n-k+1)]` of n independent samples holds their distribution's median."""
    if not 1 <= k <= (n + 1) // 2:
        raise ValueError(f"rank k must be in [1, {(n + 1) // 2}] for n = {n}, got {k}")
    below = sum(math.comb(n, i) for i in range(k)) / 2 ** n  # P(Binomial(n, 1/2) <= k - 1)
    return 1.0 - 2.0 * below


def interval_rank(n: int, confidence: float) -> Optional[int]:
    """The largest k whose interval `[x_(k), x_(n-k+1)]` covers the median with at least `confidence`;
    None when n samples cannot (even `[min, max]` covers less)."""
    best = None
    for k in range(1, (n + 1) // 2 + 1):
        if coverage(n, k) < confidence:
            break
        best = k
    return best


def repeats_needed(confidence: float) -> int:
    """The fewest samples whose `[min, max]` reaches `confidence` (5 at 0.9, 6 at 0.95)."""
    if not 0.0 < confidence < 1.0:
        raise ValueError(f"confidence must be in (0, 1), got {confidence!r}")
    n = 1
    while interval_rank(n, confidence) is None:
        n += 1
    return n


def median_interval(values: Sequence[Optional[float]], confidence: float) -> Interval:
    """Order-statistic interval for the median of `values`; None entries count as -inf below and +inf above."""
    n = len(values)
    k = interval_rank(n, confidence) if n else None
    if k is None:
        return UNBOUNDED
    defined = sorted(v for v in values if v is not None)
    missing = n - len(defined)
    # lower end: the k-th smallest with the missing at -inf; upper end: the k-th largest with them at +inf
    low = defined[k - 1 - missing] if k > missing else None
    high = defined[n - k] if k > missing else None
    return Interval(low, high)


def per_repeat_ratios(numerator: Sequence[float], denominator: Sequence[float]) -> list[Optional[float]]:
    """`num_i / den_i - 1` per repeat; None where either time is not positive (no meaningful ratio)."""
    if len(numerator) != len(denominator):
        raise ValueError(f"ratios need paired repeats, got {len(numerator)} and {len(denominator)} values")
    return [n / d - 1.0 if n > 0 and d > 0 else None for n, d in zip(numerator, denominator)]


def median_of_defined(values: Sequence[Optional[float]]) -> Optional[float]:
    """The median, or None when half or more of the values are undefined (then it is not determined)."""
    defined = [v for v in values if v is not None]
    if not defined or 2 * len(defined) <= len(values):
        return None
    return float(statistics.median(defined))


@dataclass(frozen=True)
class RatioSummary:
    point: Optional[float]  # median per-repeat ratio minus one
    interval: Interval


def summarise_ratio(numerator: Sequence[float], denominator: Sequence[float], confidence: float) -> RatioSummary:
    ratios = per_repeat_ratios(numerator, denominator)
    return RatioSummary(median_of_defined(ratios), median_interval(ratios, confidence))


def summarise_ratios(per_repeat: dict[str, Sequence[float]], confidence: float) -> dict[str, RatioSummary]:
    """Every ratio of `RATIOS` whose two variants were measured."""
    return {key: summarise_ratio(per_repeat[num], per_repeat[den], confidence)
            for key, num, den in RATIOS if num in per_repeat and den in per_repeat}


def bem_spread(per_repeat: dict[str, Sequence[float]], confidence: float) -> float:
    """Half-width of BEM-over-base's interval: what the stopping rule drives down."""
    return median_interval(per_repeat_ratios(per_repeat["bem"], per_repeat["base"]), confidence).half_width


def describe(interval: Interval) -> str:
    """'[+3.1%, +6.4%]', with '-inf' / '+inf' at an unbounded end."""
    low = "-inf" if interval.low is None else f"{100 * interval.low:+.1f}%"
    high = "+inf" if interval.high is None else f"{100 * interval.high:+.1f}%"
    return f"[{low}, {high}]"


def as_dicts(summaries: dict[str, RatioSummary]) -> dict[str, Any]:
    return {key: summary.interval.to_dict() for key, summary in summaries.items()}
