"""scripts/saved_tensors_diff.py on the CPU: a BEM training step keeps for its backward what LoRA's keeps, plus its
codes (rows x rank), and the script prints each variant's total and the rows that differ."""

from __future__ import annotations

import sys
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import saved_tensors_diff  # noqa: E402


def test_bem_keeps_what_lora_keeps_and_its_codes(monkeypatch, capsys):
    monkeypatch.setattr(sys, "argv", ["saved_tensors_diff.py", "--config", str(REPO / "configs/profile_tiny.yaml"),
                                      "--batch", "2", "--seq-len", "24", "--device", "cpu"])
    saved_tensors_diff.main()
    lines = capsys.readouterr().out.splitlines()
    totals = {line.split(":")[0]: float(line.split("saved ")[1].split(" MiB")[0]) for line in lines[:2]}
    assert set(totals) == {"bem", "lora"} and totals["lora"] > 0
    rows = [line.split() for line in lines[3:]]
    assert rows, "no row differs: BEM keeps its codes beside what LoRA keeps"
    for difference, _, _, *kind in rows:  # each row BEM keeps more of is r wide (the codes), none less
        shape = " ".join(kind).rsplit(",", 1)[0]
        assert float(difference) > 0 and shape.endswith(", 8)"), rows
