"""GPU tests exercise the fused kernels themselves, also where autograd is recording: the default
dispatch would hand prefill-sized training calls to the reference (see ops.TRAINING_USES_REFERENCE)."""

import pytest

from bem.kernels import ops


@pytest.fixture(autouse=True)
def fused_kernels_under_autograd(monkeypatch):
    monkeypatch.setattr(ops, "TRAINING_USES_REFERENCE", False)
