"""A pytest plugin for `scripts/gpu_crash_probe.sh`: Python's cyclic garbage collector runs after every test,
so that what a test dropped is destroyed before the next test starts (never in the middle of its CUDA-graph
captures). Load it with `PYTHONPATH=scripts python -m pytest -p pytest_collect_garbage ...`."""

from __future__ import annotations

import gc

import pytest


@pytest.fixture(autouse=True)
def _collect_garbage_after_the_test():
    yield
    gc.collect()
