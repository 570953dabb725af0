"""The profiler's noise handling on synthetic samples: the median's interval, the stopping rule, the gate."""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

from bem.profiling.gate import judge, overall
from bem.profiling.statistics import (Interval, coverage, interval_rank, median_interval, median_of_defined,
                                      per_repeat_ratios, repeats_needed, summarise_ratios)
from bem.profiling.stopping import StopRule
from bem.profiling.timing import Clock, interleaved_until


# ---------------------------------------------------------------------- the interval
def test_coverage_is_the_binomial_probability_of_the_order_statistics():
    assert coverage(5, 1) == pytest.approx(1 - 2 / 32)  # [min, max] of 5 misses the median w.p. 2 * 2^-5
    assert coverage(10, 2) == pytest.approx(1 - 2 * (1 + 10) / 1024)
    with pytest.raises(ValueError, match="rank k"):
        coverage(4, 3)


@pytest.mark.parametrize("confidence, needed", [(0.5, 2), (0.75, 3), (0.9, 5), (0.95, 6), (0.99, 8)])
def test_repeats_needed_is_the_fewest_that_bound_an_interval(confidence, needed):
    assert repeats_needed(confidence) == needed
    assert interval_rank(needed, confidence) == 1 and interval_rank(needed - 1, confidence) is None


def test_the_rank_grows_with_the_repeats_and_keeps_its_coverage():
    ranks = [interval_rank(n, 0.9) for n in range(5, 60)]
    assert ranks == sorted(ranks) and ranks[-1] > 15
    for n, k in zip(range(5, 60), ranks):
        assert coverage(n, k) >= 0.9 and (k + 1 > (n + 1) // 2 or coverage(n, k + 1) < 0.9)


def test_median_interval_takes_the_order_statistics():
    values = [0.05, 0.01, 0.03, 0.04, 0.02]
    assert median_interval(values, 0.9) == Interval(0.01, 0.05)  # five repeats: [min, max]
    values = list(range(20))
    k = interval_rank(20, 0.9)
    assert median_interval(values, 0.9) == Interval(k - 1, 20 - k)
    assert median_interval([1.0, 2.0, 3.0, 4.0], 0.9).bounded is False  # four cannot give 90%
    assert median_interval([], 0.9).half_width == math.inf


def test_undefined_repeats_count_against_both_ends():
    values = [None] + list(range(1, 20))  # one undefined among 20
    k = interval_rank(20, 0.9)
    assert median_interval(values, 0.9) == Interval(k - 1, 20 - k + 1)  # shifted down on one end, up on the other
    assert median_interval([None, 1.0, 2.0, 3.0, 4.0], 0.9) == Interval(None, None)


def test_the_interval_covers_the_true_median_about_as_often_as_promised():
    rng = random.Random(0)
    for n in (5, 12, 30):
        inside = 0
        for _ in range(2000):
            interval = median_interval([rng.lognormvariate(0, 0.5) for _ in range(n)], 0.9)
            inside += interval.low <= 1.0 <= interval.high  # the lognormal's median is 1
        assert inside / 2000 >= coverage(n, interval_rank(n, 0.9)) - 0.03


def test_per_repeat_ratios_and_their_median():
    assert per_repeat_ratios([11.0, 12.0, 0.0], [10.0, 10.0, 10.0]) == pytest.approx([0.1, 0.2, None])
    with pytest.raises(ValueError, match="paired repeats"):
        per_repeat_ratios([1.0], [1.0, 2.0])
    assert median_of_defined([0.1, None, 0.3]) == pytest.approx(0.2)
    assert median_of_defined([0.1, None, None, 0.3]) is None  # half undefined: the median is not determined


def test_summaries_pair_each_repeat_so_drift_cancels():
    # every repeat 10% slower for BEM, while the whole machine drifts 3x: the ratio sees no drift
    drift = [1.0, 1.5, 2.0, 3.0, 2.5, 1.2]
    per_repeat = {"base": [10 * d for d in drift], "bem": [11 * d for d in drift], "lora": [13 * d for d in drift]}
    summary = summarise_ratios(per_repeat, 0.9)
    assert summary["bem_overhead"].point == pytest.approx(0.1)
    assert summary["bem_overhead"].interval.half_width == pytest.approx(0.0)
    assert summary["bem_vs_lora"].point == pytest.approx(11 / 13 - 1)
    assert set(summarise_ratios({"base": [1.0] * 5, "bem": [1.0] * 5}, 0.9)) == {"bem_overhead"}


# ---------------------------------------------------------------------- the stopping rule
def test_stop_rule_reasons():
    rule = StopRule(min_repeats=5, max_repeats=10, target_spread=0.01, max_seconds=2.0)
    assert rule.reason(4, 0.0, 100.0) is None  # never before min_repeats, however good or late
    assert rule.reason(5, 0.005, 0.1) == "target_spread"
    assert rule.reason(5, 0.02, 0.1) is None
    assert rule.reason(6, 0.02, 2.5) == "max_seconds"
    assert rule.reason(10, 0.02, 0.1) == "max_repeats"
    assert rule.reason(10, 0.01, 0.1) == "target_spread"
    with pytest.raises(ValueError, match="min_repeats <= max_repeats"):
        StopRule(5, 4, 0.01, 1.0)


def test_a_timed_call_runs_with_the_garbage_collector_paused():
    import gc

    clock = Clock(torch.device("cpu"))
    seen = []
    clock.time_ms(lambda: seen.append(gc.isenabled()))
    assert seen == [False] and gc.isenabled()
    gc.disable()  # a caller that paused it keeps it paused
    try:
        clock.time_ms(lambda: None)
        assert not gc.isenabled()
    finally:
        gc.enable()


class FakeClock(Clock):
    """Each workload returns its own duration in ms; the 'time' advances by it."""

    def __init__(self) -> None:
        super().__init__(torch.device("cpu"))
        self.now = 0.0

    def time_ms(self, fn):
        ms = float(fn())
        self.now += ms / 1e3
        return ms


def _noisy_workloads(spread: float, seed: int = 0) -> dict:
    rng = random.Random(seed)
    return {"base": lambda i: 10.0 * (1 + spread * rng.uniform(-1, 1)),
            "bem": lambda i: 11.0 * (1 + spread * rng.uniform(-1, 1))}


def _spread(samples: dict) -> float:
    return median_interval(per_repeat_ratios(samples["bem"], samples["base"]), 0.9).half_width


def test_repeats_stop_once_the_spread_reaches_the_target():
    clock = FakeClock()
    rule = StopRule(min_repeats=5, max_repeats=200, target_spread=0.02, max_seconds=1e9)
    samples, reason = interleaved_until(_noisy_workloads(0.1), clock, 0, rule, _spread, now=lambda: clock.now)
    n = len(samples["base"])
    assert reason == "target_spread" and 5 < n < 200
    assert _spread(samples) <= 0.02
    shorter = {key: values[:-1] for key, values in samples.items()}
    assert _spread(shorter) > 0.02  # it stopped at the first repeat that reached the target


def test_quiet_timings_stop_at_min_repeats_and_noisy_ones_at_the_budget():
    clock = FakeClock()
    quiet = StopRule(min_repeats=5, max_repeats=50, target_spread=0.01, max_seconds=1e9)
    samples, reason = interleaved_until(_noisy_workloads(0.0), clock, 2, quiet, _spread, now=lambda: clock.now)
    assert (reason, len(samples["bem"])) == ("target_spread", 5)
    loud = StopRule(min_repeats=5, max_repeats=12, target_spread=0.001, max_seconds=1e9)
    samples, reason = interleaved_until(_noisy_workloads(0.5), clock, 0, loud, _spread, now=lambda: clock.now)
    assert (reason, len(samples["bem"])) == ("max_repeats", 12)
    clock = FakeClock()
    timed = StopRule(min_repeats=5, max_repeats=1000, target_spread=0.001, max_seconds=0.5)  # 21 ms a repeat
    samples, reason = interleaved_until(_noisy_workloads(0.5), clock, 0, timed, _spread, now=lambda: clock.now)
    assert reason == "max_seconds" and 0.5 <= clock.now < 0.5 + 0.03


def test_the_spread_is_not_asked_for_before_min_repeats():
    asked = []
    rule = StopRule(min_repeats=4, max_repeats=6, target_spread=1.0, max_seconds=1e9)
    clock = FakeClock()
    interleaved_until({"base": lambda i: 1.0, "bem": lambda i: 1.0}, clock, 0, rule,
                      lambda s: asked.append(len(s["base"])) or 0.0, now=lambda: clock.now)
    assert asked == [4]


# ---------------------------------------------------------------------- the gate
def _setting(low, high, gated=True, problem=None, point=0.1):
    return {"name": "s", "gated": gated, "bem_overhead": point, "problem": problem, "repeats": 7,
            "intervals": {"bem_overhead": {"low": low, "high": high}}}


@pytest.mark.parametrize("low, high, verdict, words", [
    (0.16, 0.30, "fail", "lower end +16.0% above 15.0%"),
    (0.02, 0.15, "pass", "upper end +15.0% within 15.0%"),
    (0.10, 0.20, "undecided", "holds the threshold"),
    (None, None, "undecided", "unbounded interval after 7 repeats"),
    (0.15, 0.16, "undecided", "holds the threshold"),  # the lower end at the threshold is not above it
])
def test_gate_outcomes(low, high, verdict, words):
    got, why = judge(_setting(low, high), 0.15)
    assert got == verdict and words in why


def test_gate_ungated_and_problems():
    assert judge(_setting(0.5, 0.9, gated=False), 0.15) == ("ungated", "not gated")
    assert judge(_setting(None, None, problem="no per-token time"), 0.15) == ("undecided", "no per-token time")
    assert judge(_setting(0.2, 0.3, problem="lora in 1 of 9"), 0.15)[0] == "fail"  # decided despite LoRA's problem


def test_overall_verdict_orders_fail_before_undecided():
    for verdicts in itertools.permutations(["pass", "fail", "undecided", "ungated"]):
        assert overall(list(verdicts)) == "fail"
    assert overall(["pass", "undecided", "ungated"]) == "undecided"
    assert overall(["pass", "ungated"]) == overall([]) == "pass"
