"""Optimizer over BEM's trainable parameters only, and the learning-rate schedule."""

from __future__ import annotations

import math
from typing import Any, Optional, Sequence

import torch
import torch.nn as nn

from .schema import TrainingSection


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise RuntimeError("the model has no trainable parameters: BEM modules should have been trainable")
    return params


def param_groups(params: Sequence[nn.Parameter], apart: Sequence[nn.Parameter] = ()) -> list[dict[str, Any]]:
    """`params` as optimizer param groups, with those of `apart` (what FSDP leaves whole) in a group of their
    own: the multi-tensor (foreach) step of torch's optimizers takes a group's tensors together, and cannot
    mix the sharded tensors FSDP makes of the others with plain ones."""
    kept = {id(p) for p in apart}
    groups = [[p for p in params if id(p) not in kept], [p for p in params if id(p) in kept]]
    return [{"params": group} for group in groups if group]


def fused_on_cuda(params: Sequence[torch.Tensor], device: Optional[torch.device] = None) -> dict[str, bool]:
    """AdamW's options for `params`: `fused=True` where all of them are floating-point tensors that are on a CUDA
    device, or that will be there by the first step (`device`: where the launcher moves the model; the trainer
    builds its optimizer before accelerate's `prepare` does), and torch's own choice elsewhere. Fused, the whole
    step is one kernel launch per group and dtype; under FSDP also one pass through the sharded tensors' dispatch
    instead of one per multi-tensor operation, host time that showed between two-GPU steps."""
    on_cuda = device is not None and torch.device(device).type == "cuda"
    fused = bool(params) and all((p.is_cuda or (on_cuda and p.device.type == "cpu")) and p.is_floating_point()
                                 for p in params)
    return {"fused": True} if fused else {}


def build_optimizer(params: list[nn.Parameter], training: TrainingSection,
                    apart: Sequence[nn.Parameter] = (), device: Optional[torch.device] = None) -> torch.optim.Optimizer:
    """AdamW over `params` (see `param_groups`); `device`: where the parameters will be at the first step."""
    return torch.optim.AdamW(param_groups(params, apart), lr=training.lr,
                             betas=(training.adam_beta1, training.adam_beta2), weight_decay=training.weight_decay,
                             **fused_on_cuda(params, device))


def lr_factor(step: int, total_steps: int, warmup_steps: int, kind: str) -> float:
    """Multiplier of the peak LR at `step` (0-based): linear warm-up, then constant, linear or cosine decay."""
    if warmup_steps > 0 and step < warmup_steps:
        return (step + 1) / warmup_steps
    if kind == "constant":
        return 1.0
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if kind == "linear":
        return 1.0 - progress
    return 0.5 * (1.0 + math.cos(math.pi * progress))


def build_scheduler(optimizer: torch.optim.Optimizer, training: TrainingSection,
                    total_steps: int) -> torch.optim.lr_scheduler.LambdaLR:
    return torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: lr_factor(step, total_steps, training.warmup_steps, training.scheduler)
    )
