"""When a setting has been measured enough: its spread is small, or its repeat or time budget is spent.

The rule is checked after every timed repeat. It never stops before `min_repeats`, so a lucky early
agreement cannot end a measurement, and never runs past `max_repeats`; between the two it stops as
soon as BEM-over-base's interval is within ±`target_spread`, or once `max_seconds` of timed repeats
have passed. The reason it stopped goes into the report.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

STOP_REASONS = ("target_spread", "max_repeats", "max_seconds")


@dataclass(frozen=True)
class StopRule:
    min_repeats: int
    max_repeats: int
    target_spread: float  # half-width of BEM over base's interval, as a fraction (0.01 = ±1 point)
    max_seconds: float  # timed repeats of one setting, warm-up not counted

    def __post_init__(self) -> None:
        if not 1 <= self.min_repeats <= self.max_repeats:
            raise ValueError(f"need 1 <= min_repeats <= max_repeats, got {self.min_repeats} and {self.max_repeats}")

    def reason(self, repeats: int, spread: float, elapsed_seconds: float) -> Optional[str]:
        """Why to stop after `repeats` repeats with this spread and time spent, or None to go on."""
        if repeats < self.min_repeats:
            return None
        if spread <= self.target_spread:
            return "target_spread"
        if repeats >= self.max_repeats:
            return "max_repeats"
        if elapsed_seconds >= self.max_seconds:
            return "max_seconds"
        return None
