"""CUDA-graph replay of the controller's calls at inference.

The controller's work is dozens of small kernels whose launch cost, not their work, is what a user pays:
once per generated token (the one-token decode step) and once per prompt (the whole-sequence call: 1.65
ms of host time at 1024 tokens on an H200, a ninth of a 1B model's whole prefill). For inference on CUDA
such a call is captured per input shape and replayed: inputs are copied into the graph's buffers, one
replay runs every kernel, and the codes and the routing state are copied out, so that no two calls or
caches ever share them. The inputs that `routing_stats()` computes the per-level tensors from stay the
graph's own: they always hold the latest call's values.

- the decode step is captured the first time a shape is seen (generation repeats it every token);
- a whole-sequence call the second time (a prompt length seen once costs no capture). Each graph keeps
  its intermediates' memory (measured on an H100, `scripts/controller_profile.py`: about 40 MiB plus 4 bytes
  per code value, tokens x modules x rank; 59 MiB for 4 x 1024 tokens of a 1B Llama, 112 modules at rank 8,
  74 MiB for 13.8M code values). So a call is captured only up to `FORWARD_MAX_CODE_VALUES`, and the graphs
  kept hold at most `FORWARD_KEPT_CODE_VALUES` together and number at most `MAX_FORWARD_GRAPHS`, the
  oldest making room for a new one.

Set `BEM_CONTROLLER_GRAPHS=0` to run every call eagerly.
"""

from __future__ import annotations

import os
from typing import Callable, Optional, Sequence

import torch
import torch.nn as nn


FORWARD_MAX_CODE_VALUES = 2**24
FORWARD_KEPT_CODE_VALUES = 2**25
MAX_FORWARD_GRAPHS = 4
MAX_STEP_GRAPHS = 8


# Captured calls of controllers that were destroyed while a CUDA graph was being captured: a controller and
# its graphs refer to each other, so Python's cyclic garbage collector destroys them, at whatever allocation
# it runs on, also one inside another capture (as inductor's CUDA-graph trees record a compiled step), where
# tearing down a graph and its memory pool is not safe. They are kept here until a call outside a capture.
_DEFERRED: list["_CapturedCall"] = []


def _capturing() -> bool:
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _clear_cublas_workspaces() -> None:
    """Drop cuBLAS's per-stream workspaces, so that the next capture allocates its own in its graph's pool.

    PyTorch keeps one workspace per (handle, stream), and every `torch.cuda.graph` without a stream captures on
    the same stream. A capture that finds a workspace there embeds its address, which may belong to an earlier,
    since dropped graph's pool (a user's own capture, say); inductor's CUDA-graph trees clear the workspaces
    around their recording, that memory is freed, and this graph's replay then writes to freed memory. Cleared
    before a capture, the workspace comes from the graph's own pool and lives as long as the graph; cleared
    after, no later capture embeds it.
    """
    clear = getattr(torch._C, "_cuda_clearCublasWorkspaces", None)
    if clear is not None:
        clear()


def _release_deferred() -> None:
    if _DEFERRED and not _capturing():
        _DEFERRED.clear()


class _CapturedCall:
    """One call captured with its input buffers; `run` copies new inputs in and replays it."""

    def __init__(self, math: Callable[..., tuple], inputs: Sequence[Optional[torch.Tensor]]) -> None:
        self.inputs = _clone(inputs)
        self.device = inputs[0].device
        with torch.cuda.device(self.device):  # the graph and its streams on the inputs' device
            side_stream = torch.cuda.Stream()
            side_stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(side_stream):  # warm-up outside the graph, as capture requires
                math(*self.inputs)
            torch.cuda.current_stream().wait_stream(side_stream)
            self.graph = torch.cuda.CUDAGraph()
            _clear_cublas_workspaces()
            try:
                with torch.cuda.graph(self.graph):
                    self.outputs = math(*self.inputs)
            finally:
                _clear_cublas_workspaces()

    def run(self, inputs: Sequence[Optional[torch.Tensor]]) -> tuple:
        for buffer, value in zip(self.inputs, inputs):
            if buffer is not None:
                buffer.copy_(value)
        if self.device.index == torch.cuda.current_device():
            self.graph.replay()
        else:
            with torch.cuda.device(self.device):
                self.graph.replay()
        return self.outputs


def _clone(tensors: Sequence[Optional[torch.Tensor]]) -> list[Optional[torch.Tensor]]:
    return [None if t is None else t.clone() for t in tensors]


def _signature(tensors: Sequence[Optional[torch.Tensor]]) -> tuple:
    return tuple(None if t is None else (tuple(t.shape), t.dtype, t.device) for t in tensors)


class ControllerGraphs:
    """Per-controller cache of captured calls (decode steps and whole-sequence calls)."""

    def __init__(self, controller: nn.Module) -> None:
        self._controller_ref = [controller]  # a list: not registered as a submodule
        self._steps: dict[tuple, _CapturedCall] = {}
        self._forwards: dict[tuple, _CapturedCall] = {}
        self._forward_values: dict[tuple, int] = {}  # code values of each kept whole-sequence graph
        self._forward_sightings: dict[tuple, int] = {}
        self.enabled = os.environ.get("BEM_CONTROLLER_GRAPHS", "1") != "0"

    def __del__(self) -> None:
        try:
            if _capturing():
                _DEFERRED.extend([*self._steps.values(), *self._forwards.values()])
        except Exception:  # noqa: BLE001 - at interpreter exit torch may be half torn down: nothing to keep
            pass

    def _usable(self, hidden: torch.Tensor) -> bool:
        return (
            self.enabled
            and hidden.is_cuda
            and not torch.is_grad_enabled()
            and not torch.compiler.is_compiling()
            and not torch.cuda.is_current_stream_capturing()
        )

    def _parameters_key(self) -> tuple:
        # parameters are read by address: a replaced parameter (not an in-place update) needs a new capture
        return tuple(p.data_ptr() for p in self._controller_ref[0].parameters())

    # ------------------------------------------------------------------ decode step
    def step_eligible(self, hidden: torch.Tensor) -> bool:
        return hidden.shape[1] == 1 and self._usable(hidden)

    def run_step(self, hidden: torch.Tensor, mask: torch.Tensor, state: tuple, out_dtype: torch.dtype):
        _release_deferred()
        controller = self._controller_ref[0]
        controller.stacked.refresh(controller)  # a replay reads the kept stacked weights: up to date first
        inputs = (hidden, mask, *state)
        key = (_signature(inputs), out_dtype, self._parameters_key())
        captured = self._steps.get(key)
        if captured is None:
            if len(self._steps) >= MAX_STEP_GRAPHS:
                self._steps.clear()
            math = lambda *tensors: controller.step_math(*tensors, out_dtype=out_dtype)  # noqa: E731
            with controller.stacked.own_capture():
                captured = self._steps[key] = _CapturedCall(math, inputs)
        codes, levels, *advanced = captured.run(inputs)
        return (codes.clone(), levels, *_clone(advanced))

    # ------------------------------------------------------------------ whole sequences
    def _code_values(self, hidden: torch.Tensor) -> int:
        controller = self._controller_ref[0]
        return hidden.shape[0] * hidden.shape[1] * controller.num_modules * controller.rank

    def forward_eligible(self, hidden: torch.Tensor) -> bool:
        return self._code_values(hidden) <= FORWARD_MAX_CODE_VALUES and self._usable(hidden)

    def run_forward(self, hidden: torch.Tensor, mask: Optional[torch.Tensor], side_signals: Optional[torch.Tensor],
                    out_dtype: torch.dtype, return_state: bool) -> Optional[tuple]:
        """(codes, levels, state tensors or None) from a replay, or None where the call is not captured
        (yet): the caller then runs it eagerly."""
        _release_deferred()
        controller = self._controller_ref[0]
        controller.stacked.refresh(controller)  # a replay reads the kept stacked weights: up to date first
        inputs = (hidden, mask, side_signals)
        key = (_signature(inputs), out_dtype, return_state, self._parameters_key())
        captured = self._forwards.get(key)
        if captured is None:
            sightings = self._forward_sightings.get(key, 0) + 1
            if sightings < 2:
                if len(self._forward_sightings) >= 64:
                    self._forward_sightings.clear()
                self._forward_sightings[key] = sightings
                return None
            self._forward_sightings.pop(key, None)
            values = self._code_values(hidden)
            while self._forwards and (len(self._forwards) >= MAX_FORWARD_GRAPHS or
                                      sum(self._forward_values.values()) + values > FORWARD_KEPT_CODE_VALUES):
                oldest = next(iter(self._forwards))
                del self._forwards[oldest], self._forward_values[oldest]
            math = lambda h, m, s: controller.forward_math(h, m, s, out_dtype, return_state)  # noqa: E731
            with controller.stacked.own_capture():
                captured = self._forwards[key] = _CapturedCall(math, inputs)
            self._forward_values[key] = values
        codes, levels, state = captured.run(inputs)
        return codes.clone(), levels, None if state is None else tuple(_clone(state))
