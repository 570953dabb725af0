"""FSDP over a 4-bit base on two CPU processes (gloo), as PEFT's FSDP + QLoRA recipe runs it: the packed weights
stored as a floating-point dtype (`quant_storage`), so that FSDP shards them with the rest of the frozen base. The
run loses a process after step 7 and resumes from its step-4 checkpoint; then:

- FSDP holds about half of the frozen 4-bit base on each process;
- the resumed run repeats the lost steps bit for bit;
- the whole run matches one process over the same global batch on the same 4-bit base;
- both processes end with the adapter that was saved.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from test_training_multiprocess import (adapter, assert_lost_steps_repeated, assert_matches_one_process, assert_same,
                                        crash_then_resume, make_root, train_one_process)

pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")

# float32 storage and compute: the tiny config's base is float32, and FSDP shards floating-point parameters only
QUANTIZED = "model.quantization={bits: 4, quant_type: nf4, compute_dtype: float32, quant_storage: float32}"


@pytest.fixture(scope="module")
def root(tmp_path_factory) -> Path:
    return make_root(tmp_path_factory, "fsdp_4bit")


@pytest.fixture(scope="module")
def run(root) -> Path:
    output_dir = root / "fsdp"
    crash_then_resume(root, {"fsdp": output_dir}, QUANTIZED)
    return output_dir


@pytest.fixture(scope="module")
def one_process(root) -> Path:
    return train_one_process(root, QUANTIZED)


def test_fsdp_shards_the_4bit_base(run):
    for rank in (0, 1):
        record = json.loads((run / f"rank{rank}.json").read_text())
        assert record["frozen_sharded"] and record["held"] < 0.7 * record["numel"], record
        assert record["accelerate_fsdp2"] and not record["groups_mix_sharded_and_whole"]


def test_resuming_repeats_the_lost_steps_exactly(run):
    assert_lost_steps_repeated(run)


def test_two_processes_match_one_process_on_the_same_4bit_base(run, one_process):
    assert_matches_one_process(run, one_process)


def test_both_processes_end_with_the_adapter_that_was_saved(run):
    rank0, rank1 = adapter(run / "rank0.safetensors"), adapter(run / "rank1.safetensors")
    assert_same(rank0, rank1)
    assert_same(rank0, adapter(run / "adapter"))
