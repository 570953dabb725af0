"""`HostCopy`: a CUDA tensor kept in pinned host memory from the forward to the backward.

The controller's input projection is recomputed in the backward from the hidden states entering the first
block. Kept on the GPU, those hidden states (tokens x hidden size) would outlive the forward only for the
controller: the first block of an RMSNorm model keeps a float32 copy of them, not the tensor itself. A copy
in host memory, made on a side stream while the forward goes on, brings them back for the recompute.
"""

from __future__ import annotations

from typing import Optional

import torch

_SIDE_STREAMS: dict[torch.device, torch.cuda.Stream] = {}


def _side_stream(device: torch.device) -> torch.cuda.Stream:
    stream = _SIDE_STREAMS.get(device)
    if stream is None:
        stream = _SIDE_STREAMS[device] = torch.cuda.Stream(device)
    return stream


def host_copy_applies(tensor: torch.Tensor) -> bool:
    """Whether `HostCopy` takes `tensor`: a CUDA tensor that needs no gradient (the copy does not carry one),
    outside a CUDA-graph capture (which cannot hold a copy to host memory)."""
    return tensor.is_cuda and not tensor.requires_grad and not torch.cuda.is_current_stream_capturing()


class HostCopy:
    """Holds `tensor` until `release()`, and a pinned host copy of it after: `get()` returns the tensor itself
    while it is held, and a new device copy of the host one afterwards (ordered after the host copy's
    completion on the caller's stream)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.device = tensor.device
        self._held: Optional[torch.Tensor] = tensor
        side = _side_stream(tensor.device)
        side.wait_stream(torch.cuda.current_stream(tensor.device))  # the tensor's producer has finished
        self._host = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
        with torch.cuda.stream(side):
            self._host.copy_(tensor, non_blocking=True)
            self._copied = torch.cuda.Event()
            self._copied.record(side)
        tensor.record_stream(side)  # its memory is not reused before the copy has read it

    def get(self) -> torch.Tensor:
        if self._held is not None:
            return self._held
        torch.cuda.current_stream(self.device).wait_event(self._copied)
        return self._host.to(self.device, non_blocking=True)

    def release(self) -> None:
        """Drops the device tensor: later `get()` calls copy the host one back."""
        self._held = None
