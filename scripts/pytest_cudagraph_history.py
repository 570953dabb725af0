"""A pytest plugin for `scripts/gpu_crash_probe.sh`: inductor's CUDA-graph trees record where each allocation of
their memory pool was made, so that a pool check that finds tensors it does not account for names their
origins. Load it with `PYTHONPATH=scripts python -m pytest -p pytest_cudagraph_history ...`."""

from __future__ import annotations

import torch._inductor.config as inductor_config

inductor_config.triton.cudagraph_trees_history_recording = True
