"""A pytest plugin for `scripts/gpu_crash_probe.sh`: the controller's captures leave cuBLAS's workspaces as they
find them (its `_clear_cublas_workspaces` made a no-op), as before that clearing existed, to show what it mends.
Load it with `PYTHONPATH=scripts python -m pytest -p pytest_no_workspace_clearing ...`."""

from __future__ import annotations

from bem.modules import controller_graphs

controller_graphs._clear_cublas_workspaces = lambda: None
