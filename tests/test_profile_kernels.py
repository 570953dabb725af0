"""`--kernels`: the micro-benchmark report, and the accuracy check catching a wrong or NaN op."""

from __future__ import annotations

import json

import pytest
import torch

from bem.kernels import ops
from bem.profiling import kernels
from bem.profiling.cli import main
from bem.profiling.config import KernelSpec
from bem.profiling.schema import validate_kernel_report

SMALL = KernelSpec(shapes=[[8, 64, 96, 4], [64, 128, 64, 8]])


def test_kernels_mode_writes_a_valid_report(tmp_path, capsys):
    assert main(["--kernels", "--repeats", "5", "--output-dir", str(tmp_path)]) == 0
    report = json.loads((tmp_path / "tiny_kernels.json").read_text())
    assert validate_kernel_report(report) == []
    assert report["passed"] and report["copy_gbps"] > 0 and report["matmul_tflops"] > 0
    order = ("tokens", "in_features", "out_features", "rank")
    assert [[row["shape"][k] for k in order] for row in report["benchmarks"]] == KernelSpec().shapes
    assert "% copy" in capsys.readouterr().out


def test_bytes_count_reads_and_the_write():
    # x (M K) + V (K r) + codes (M r) + U (N r) read, output (M N) written, 2 bytes each
    assert kernels.update_bytes(4, 16, 32, 2, 2) == 2 * (64 + 32 + 8 + 64 + 128)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_accuracy_of_the_dispatch_op_passes(dtype):
    for shape in SMALL.shapes:
        row = kernels.validate_numerical_accuracy(shape, dtype, torch.device("cpu"))
        assert row["passed"], row
        assert row["relative_error"] <= row["tolerance"]


def test_accuracy_check_catches_a_wrong_result(monkeypatch):
    original = ops.generated_update
    monkeypatch.setattr(ops, "generated_update", lambda *a, **k: original(*a, **k) * 1.01)
    row = kernels.validate_numerical_accuracy([16, 64, 64, 4], torch.float32, torch.device("cpu"))
    assert not row["passed"] and row["relative_error"] == pytest.approx(0.01, rel=1e-3)


def test_accuracy_check_never_passes_nan(monkeypatch):
    def poisoned(*args, **kwargs):
        out = ops_original(*args, **kwargs)
        out[0, 0] = float("nan")
        return out

    ops_original = ops.generated_update
    monkeypatch.setattr(ops, "generated_update", poisoned)
    row = kernels.validate_numerical_accuracy([16, 64, 64, 4], torch.float32, torch.device("cpu"))
    assert row["passed"] is False and row["relative_error"] is None


def test_kernels_mode_exits_1_on_an_inaccurate_op(monkeypatch, tmp_path, capsys):
    original = ops.generated_update
    monkeypatch.setattr(ops, "generated_update", lambda *a, **k: original(*a, **k) * 1.5)
    assert main(["--kernels", "--repeats", "5", "--output-dir", str(tmp_path)]) == 1
    assert "less accurate than tolerated" in capsys.readouterr().err
