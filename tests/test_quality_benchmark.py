"""The quality benchmark (benchmarks/quality.py): its tasks are what they say, its variants meet the equal
budget, and a shortened run on a tiny random base completes with a table. What a short run can assert
robustly is the bookkeeping, not which adapter wins."""

from __future__ import annotations

import json
import math
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

import quality  # noqa: E402
from quality_tasks import ALPHABET, EQUALS, MARKERS, VALUES, RecallSuite, TransformSuite  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")


def symbols(row: torch.Tensor) -> list[int]:
    return [ALPHABET.index(int(v)) for v in row]


def test_each_transform_row_holds_its_task_and_answer():
    suite = TransformSuite(length=7)
    ids, mask, which = suite.batch(64, torch.Generator().manual_seed(0))
    assert ids.shape == (64, 16) and mask.sum(1).tolist() == [7] * 64
    assert set(which.tolist()) == set(range(len(suite.tasks)))  # every task appears
    for row, task_index in zip(ids, which):
        task = suite.tasks[int(task_index)]
        assert int(row[0]) == MARKERS[task] and int(row[8]) == EQUALS
        x, y = symbols(row[1:8]), symbols(row[9:])
        expected = {"copy": x, "reverse": x[::-1], "sort": sorted(x), "shift": [(v + 1) % 16 for v in x],
                    "complement": [15 - v for v in x],
                    "running_max": [max(x[:i + 1]) for i in range(len(x))]}[task]
        assert y == expected, task


def test_each_recall_query_is_answered_by_its_keys_value():
    suite = RecallSuite(pairs=6, queries=3)
    ids, mask, _ = suite.batch(32, torch.Generator().manual_seed(1))
    assert ids.shape == (32, suite.sequence_length) and mask.sum(1).tolist() == [3] * 32
    for row, answers in zip(ids, mask):
        pairs = {int(row[2 * i]): int(row[2 * i + 1]) for i in range(6)}
        assert len(pairs) == 6 and all(v in VALUES for v in pairs.values())
        for position in answers.nonzero().flatten().tolist():
            assert int(row[position]) == pairs[int(row[position - 1])]


def test_recall_with_a_gap_puts_filler_between_the_pairs_and_the_queries():
    from quality_tasks import FILLER

    suite = RecallSuite(pairs=5, queries=3, gap=20)
    ids, mask, _ = suite.batch(16, torch.Generator().manual_seed(2))
    assert ids.shape == (16, suite.sequence_length) == (16, 10 + 20 + 1 + 6) and mask.sum(1).tolist() == [3] * 16
    assert set(ids[:, 10:30].flatten().tolist()) <= set(FILLER) and not set(FILLER) & (set(ALPHABET) | set(VALUES))
    for row, answers in zip(ids, mask):
        pairs = {int(row[2 * i]): int(row[2 * i + 1]) for i in range(5)}
        for position in answers.nonzero().flatten().tolist():
            assert position > 30 and int(row[position]) == pairs[int(row[position - 1])]


def test_a_windowed_base_is_a_mistral_that_attends_to_its_window_only():
    from quality_base import BaseSpec, fresh_model

    spec = BaseSpec(width=32, layers=1, heads=2, pretrain_steps=0, window=4)
    model = fresh_model(spec).eval()
    assert type(model).__name__ == "MistralForCausalLM" and model.config.sliding_window == 4
    assert type(fresh_model(BaseSpec(width=32, layers=1, heads=2, pretrain_steps=0))).__name__ == "LlamaForCausalLM"
    assert spec.key() != BaseSpec(width=32, layers=1, heads=2, pretrain_steps=0).key()
    ids = torch.randint(0, 256, (1, 12), generator=torch.Generator().manual_seed(3))
    changed = ids.clone()
    changed[0, 0] = (ids[0, 0] + 1) % 256
    with torch.no_grad():  # one layer: the last position (11) sees 8..11, not position 0
        last, last_changed = (model(input_ids=t).logits[0, -1] for t in (ids, changed))
    assert torch.equal(last, last_changed)
    with torch.no_grad():
        assert not torch.equal(model(input_ids=ids).logits[0, 2], model(input_ids=changed).logits[0, 2])


def test_a_short_run_gives_every_variant_at_an_equal_budget(tmp_path, capsys):
    out = tmp_path / "quality.json"
    code = quality.main(["--suites", "multitask", "--seeds", "2", "--steps", "12", "--batch", "8",
                         "--eval-rows", "48", "--base-width", "64", "--base-layers", "1", "--pretrain-steps", "0",
                         "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--json", str(out)])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["complete"]
    rows = {row["variant"]: row for row in report["rows"]}
    assert set(rows) == {"bem", "bem_static", "lora", "dora", "bem-prefix", "bem-chunk", "bem-token", "bem-gate"}
    for name in ("bem_static", "lora", "dora"):
        assert abs(rows[name]["budget"] - 1.0) <= 0.05, (name, rows[name]["budget"])
    assert 0 < rows["bem"]["controller_share"] < 1
    for name in ("bem-prefix", "bem-chunk", "bem-token", "bem-gate"):  # a level held: fewer trainable parameters
        assert rows[name]["trainable"] < rows["bem"]["trainable"]
    for row in rows.values():
        assert len(row["seeds"]) == 2 and 0.0 <= row["mean"] <= 1.0 and row["std"] >= 0.0
        assert all(math.isfinite(loss) for seed in row["seeds"] for loss in seed["losses"])
        assert set(row["seeds"][0]["scores"]) == set(TransformSuite().tasks) | {"mean"}
    printed = capsys.readouterr().out
    assert "| multitask | bem |" in printed and "2 seeds" in printed


def test_bad_arguments_are_refused_by_name():
    with pytest.raises(SystemExit):
        quality.main(["--suites", "multitsk"])
    with pytest.raises(SystemExit):
        quality.main(["--suites", ""])  # nothing to run
    with pytest.raises(SystemExit):
        quality.main(["--eval-rows", "8"])  # too few to score each task
    with pytest.raises(SystemExit):
        quality.main(["--controller-lr-scale", "0"])
    with pytest.raises(SystemExit):
        quality.main(["--jobs", "0"])
    with pytest.raises(SystemExit):
        quality.main(["--base-window", "-1"])
    with pytest.raises(SystemExit):
        quality.main(["--mixer-dim", "6"])  # not a multiple of the mixers' 4 heads
    with pytest.raises(SystemExit):
        quality.main(["--suites", "multitask", "--variants", "bem+hyena"])  # a mixer runs on recall only
    with pytest.raises(SystemExit):
        quality.main(["--suites", "", "--plot-ranks", "2,four"])


def test_the_controller_learns_at_its_own_rate():
    import copy

    from quality_base import BaseSpec, fresh_model

    base = fresh_model(BaseSpec(width=64, layers=1, pretrain_steps=0))
    for param in base.parameters():
        param.requires_grad_(False)
    settings = quality.Settings(lr=1e-3, controller_lr_scale=0.1)
    builders = quality.variants(lambda: copy.deepcopy(base), settings, "multitask", 4, 20)
    bem, lora = builders["bem"](), builders["lora"]()
    groups = quality.optimizer_for(bem, settings).param_groups
    assert [g["lr"] for g in groups] == pytest.approx([1e-3, 1e-4])
    assert {id(p) for p in groups[1]["params"]} == {id(p) for p in bem.controller.parameters() if p.requires_grad}
    assert sum(len(g["params"]) for g in groups) == sum(1 for p in bem.parameters() if p.requires_grad)
    assert [g["lr"] for g in quality.optimizer_for(lora, settings).param_groups] == [1e-3]


def test_the_curve_alone_runs_bem_and_lora_at_each_rank(tmp_path):
    out, png = tmp_path / "curve.json", tmp_path / "curve.png"
    code = quality.main(["--suites", "", "--seeds", "1", "--steps", "4", "--batch", "4", "--eval-rows", "48",
                         "--base-width", "64", "--base-layers", "1", "--pretrain-steps", "0", "--plot-ranks", "2,4",
                         "--plot", str(png), "--cache-dir", str(tmp_path / "cache"), "--device", "cpu",
                         "--json", str(out)])
    assert code == 0 and png.stat().st_size > 0
    report = json.loads(out.read_text())
    assert report["rows"] == []
    points = {(p["variant"], p["rank"]): p["trainable"] for p in report["rank_curve"]}
    assert set(points) == {("bem", 2), ("bem", 4), ("lora", 2), ("lora", 4)}
    assert points[("bem", 2)] < points[("bem", 4)] and points[("lora", 2)] < points[("lora", 4)]
    again = tmp_path / "again.png"  # the curve drawn again from the report alone
    assert quality.main(["--replot", str(out), "--plot", str(again)]) == 0 and again.stat().st_size > 0
    with pytest.raises(SystemExit):  # a report without a curve is refused by name
        (tmp_path / "no_curve.json").write_text(json.dumps({"rows": []}))
        quality.main(["--replot", str(tmp_path / "no_curve.json")])


def test_a_run_cut_off_keeps_the_variants_it_finished(tmp_path, monkeypatch):
    out = tmp_path / "quality.json"
    evaluate, calls = quality.evaluate, []

    def cut_off_at_the_third(*args, **kwargs):  # the second variant's first seed: as a time limit would
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return evaluate(*args, **kwargs)

    monkeypatch.setattr(quality, "evaluate", cut_off_at_the_third)
    with pytest.raises(KeyboardInterrupt):
        quality.main(["--suites", "multitask", "--seeds", "2", "--steps", "4", "--batch", "4", "--eval-rows", "48",
                      "--base-width", "64", "--base-layers", "1", "--pretrain-steps", "0", "--cache-dir",
                      str(tmp_path / "cache"), "--device", "cpu", "--json", str(out)])
    report = json.loads(out.read_text())
    assert not report["complete"]
    assert [row["variant"] for row in report["rows"]] == ["bem"] and len(report["rows"][0]["seeds"]) == 2


def test_runs_in_worker_processes_give_the_same_rows_as_in_order(tmp_path):
    """--jobs 2: the runs in two processes of their own (each loading the cached base), the rows in the table's
    order and each seed's scores equal to the same runs made one after another in this process."""
    common = ["--suites", "multitask", "--variants", "bem,lora", "--seeds", "2", "--steps", "6", "--batch", "4",
              "--eval-rows", "48", "--base-width", "64", "--base-layers", "1", "--pretrain-steps", "0",
              "--cache-dir", str(tmp_path / "cache"), "--device", "cpu", "--threads", "1"]
    reports = []
    for jobs in ("1", "2"):
        out = tmp_path / f"jobs{jobs}.json"
        assert quality.main(common + ["--jobs", jobs, "--json", str(out)]) == 0
        reports.append(json.loads(out.read_text()))
    in_order, parallel = reports
    assert [row["variant"] for row in parallel["rows"]] == ["bem", "lora"]
    for one, two in zip(in_order["rows"], parallel["rows"]):
        assert (one["trainable"], one["budget"]) == (two["trainable"], two["budget"])
        assert [s["seed"] for s in two["seeds"]] == [0, 1]
        assert [s["scores"] for s in one["seeds"]] == [s["scores"] for s in two["seeds"]]
        losses = [[loss for seed in row["seeds"] for loss in seed["losses"]] for row in (one, two)]
        assert losses[0] == pytest.approx(losses[1], rel=1e-5)
