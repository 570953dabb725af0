"""The mixers add something real: on a base whose attention window cannot reach a key 66 tokens back, BEM's
expert modules alone (routing off: plain low-rank updates) stay near chance, and BEM with either mixer learns
to recall the key (scripts/long_range_recall.py, shortened)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "scripts" / "long_range_recall.py"

pytestmark = pytest.mark.usefixtures("one_thread")


def _script():
    spec = importlib.util.spec_from_file_location("long_range_recall", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclass looks its module up there
    spec.loader.exec_module(module)
    return module


def test_bem_alone_stays_near_chance_and_either_mixer_learns_the_recall():
    results = {r["variant"]: r["accuracy"] for r in _script().run(steps=160, routing=False)}
    chance = 0.25
    assert results["bem"] < chance + 0.1, results
    assert results["bem+hyena"] > 0.9 and results["bem+mlstm"] > 0.9, results
