"""What the training benchmark measures: the two precision setups, one training step, its memory.

Setups (the frozen base is bf16 in both):
  bf16      every parameter bf16, the adapters too, no autocast
  autocast  fp32 adapters under bf16 autocast, as `bem train` runs mixed precision
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Optional

import torch
import torch.nn as nn

from bem.training.optim import fused_on_cuda


@dataclass(frozen=True)
class Setup:
    name: str
    adapter_dtype: torch.dtype
    autocast: bool

    def describe(self) -> str:
        adapters = str(self.adapter_dtype).replace("torch.", "")
        return f"bf16 base, {adapters} adapters, " + ("bf16 autocast" if self.autocast else "no autocast")


SETUPS = {"bf16": Setup("bf16", torch.bfloat16, autocast=False),
          "autocast": Setup("autocast", torch.float32, autocast=True)}


def set_trainable_dtype(model: nn.Module, dtype: torch.dtype) -> None:
    """Cast the trainable parameters (adapters, controller) in place: PEFT keeps its adapters in fp32 unless told."""
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.to(dtype)


def training_step(model: nn.Module, batches: list[torch.Tensor], setup: Setup, learning_rate: float,
                  device: torch.device) -> tuple[Callable[[int], None], torch.optim.Optimizer]:
    """One forward + backward + AdamW step per call, on batch `index % len(batches)`. AdamW is fused on CUDA, as
    `bem.training` and transformers' Trainer (its default `adamw_torch_fused`) make it, for both variants."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=learning_rate, **fused_on_cuda(params))

    def step(index: int) -> None:
        ids = batches[index % len(batches)]
        with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.autocast):
            loss = model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    return step, optimizer


def resident_bytes(model: nn.Module, optimizer: torch.optim.Optimizer) -> int:
    """What the variant keeps between steps: its parameters and its optimizer's state."""
    total = sum(p.numel() * p.element_size() for p in model.parameters())
    for state in optimizer.state.values():
        total += sum(t.numel() * t.element_size() for t in state.values() if torch.is_tensor(t))
    return int(total)


def step_memory(model: nn.Module, optimizer: torch.optim.Optimizer, step: Callable[[int], None],
                device: torch.device) -> dict[str, Optional[int]]:
    """One more step, alone: on a GPU its peak allocation above what was allocated before it, and
    `peak_bytes` = that + the variant's resident bytes (the peak it would reach alone on the device)."""
    peak_step: Optional[int] = None
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device)
    step(0)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        peak_step = int(torch.cuda.max_memory_allocated(device) - before)
    resident = resident_bytes(model, optimizer)
    return {"resident_bytes": resident, "peak_step_bytes": peak_step,
            "peak_bytes": None if peak_step is None else resident + peak_step}


def kernel_note(model: Any, tokens: int, setup: Setup, device: torch.device) -> str:
    """Which path BEM's low-rank update takes at this step's size: the fused kernels, or why not."""
    from bem.kernels import fused_unavailable_reason

    try:
        layer = model.bem_modules()[0][1]
        V, weight = layer.bem_V, layer.base_layer.weight
    except (AttributeError, IndexError):
        return "kernel path unknown"
    dtype = torch.bfloat16 if setup.autocast else V.dtype
    x = torch.zeros(1, V.shape[0], device=device, dtype=dtype).expand(tokens, V.shape[0])
    with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.autocast), torch.enable_grad():
        reason = fused_unavailable_reason(x, V, getattr(layer, "use_fused_kernels", True), weight)
    return "fused kernels" if reason is None else f"reference path: {reason}"
