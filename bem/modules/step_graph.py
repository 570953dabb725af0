"""CUDA-graph replay of the controller's one-token decode step.

At decode sizes the step is dozens of tiny kernels whose launch cost, not their work, is what a user
pays per generated token. For inference on CUDA, the step is captured once per (batch, dtypes) and
replayed: inputs are copied into the graph's buffers, one replay runs every kernel, and the advanced
state is copied out so that no two caches ever share a buffer. Set `BEM_CONTROLLER_GRAPHS=0` to run
the step eagerly.
"""

from __future__ import annotations

import os
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from .controller import HierarchicalController


class _CapturedStep:
    def __init__(self, controller: "HierarchicalController", hidden: torch.Tensor, mask: torch.Tensor,
                 state: tuple, out_dtype: torch.dtype) -> None:
        self.inputs = [hidden.clone(), mask.clone()] + [None if t is None else t.clone() for t in state]
        side_stream = torch.cuda.Stream()
        side_stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side_stream):  # warm-up outside the graph, as capture requires
            controller.step_math(*self.inputs, out_dtype=out_dtype)
        torch.cuda.current_stream().wait_stream(side_stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self.outputs = controller.step_math(*self.inputs, out_dtype=out_dtype)

    def run(self, hidden: torch.Tensor, mask: torch.Tensor, state: tuple):
        for buffer, value in zip(self.inputs, (hidden, mask, *state)):
            if buffer is not None:
                buffer.copy_(value)
        self.graph.replay()
        codes, levels, *advanced = self.outputs
        return (codes, levels, *[t.clone() for t in advanced])


class StepGraphs:
    """Per-controller cache of captured decode steps."""

    def __init__(self, controller: "HierarchicalController") -> None:
        self._controller_ref = [controller]  # a list: not registered as a submodule
        self._captured: dict[tuple, _CapturedStep] = {}
        self.enabled = os.environ.get("BEM_CONTROLLER_GRAPHS", "1") != "0"

    def eligible(self, hidden: torch.Tensor) -> bool:
        return (
            self.enabled
            and hidden.is_cuda
            and hidden.shape[1] == 1
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
        )

    def run(self, hidden: torch.Tensor, mask: torch.Tensor, state: tuple, out_dtype: torch.dtype):
        controller = self._controller_ref[0]
        # parameters are read by address: a replaced parameter (not an in-place update) needs a new capture
        key = (tuple(hidden.shape), hidden.dtype, hidden.device, out_dtype, state[-1] is None,
               tuple(p.data_ptr() for p in controller.parameters()))
        captured: Optional[_CapturedStep] = self._captured.get(key)
        if captured is None:
            if len(self._captured) >= 8:
                self._captured.clear()
            captured = self._captured[key] = _CapturedStep(controller, hidden, mask, state, out_dtype)
        return captured.run(hidden, mask, state)
