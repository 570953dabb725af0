"""How several processes share the training: DDP (`training.distributed: ddp`) or FSDP2 (`fsdp`), both
through accelerate, and the conversions between FSDP's sharded tensors and the full tensors files hold.

Under FSDP every parameter of the wrapped model is a `DTensor` sharded along its first dimension over the
processes, the frozen base as well as BEM's V and U. The routing controller is the exception: FSDP2 cannot
shard its 0-dimensional gate temperature, and it is small, so it stays whole on every process (FSDP ignores
it) and the trainer averages its gradients itself, as DDP would.
"""

from __future__ import annotations

import contextlib
import os
from typing import Any, Iterator, Optional, Sequence

import torch
import torch.nn as nn

from .schema import ConfigError, TrainingSection

LOW_PRECISION = {"bf16": torch.bfloat16, "fp16": torch.float16}
USE_FSDP = "ACCELERATE_USE_FSDP"  # set by `accelerate launch --use_fsdp` (and by accelerate for a plugin)


def make_accelerator(training: TrainingSection):
    """An `Accelerator` set up for `training.distributed`; FSDP is on when more than one process runs."""
    from accelerate import Accelerator
    from accelerate.utils import DataLoaderConfiguration

    launcher_fsdp = os.environ.get(USE_FSDP)
    if (launcher_fsdp or "").lower() == "true" and training.distributed != "fsdp":
        raise ConfigError("training.distributed", "is 'ddp', but the launcher turned FSDP on (accelerate launch "
                                                  "--use_fsdp, or an accelerate config with FSDP); set "
                                                  "training.distributed=fsdp, or launch without FSDP")
    plugin = fsdp_plugin(training) if training.distributed == "fsdp" else None
    if plugin is None:
        unshard_on_cpu()  # an earlier FSDP run on CPU in this process left accelerate's process state at FSDP
    # rng_types=[]: the data order comes from EpochSampler alone; accelerate must not reseed anything.
    # non_blocking: a batch's copy to the GPU (from pinned memory, the trainer's loader) does not wait for the
    # steps queued before it, as a blocking copy would at every micro-batch
    accelerator = Accelerator(mixed_precision=training.mixed_precision, cpu=training.cpu, rng_types=[],
                              fsdp_plugin=plugin, dataloader_config=DataLoaderConfiguration(non_blocking=True))
    if plugin is not None and launcher_fsdp is None:
        # accelerate records the plugin in the environment; the next run in this process chooses for itself
        os.environ.pop(USE_FSDP, None)
    if plugin is not None:
        shard_on_cpu(accelerator, plugin)
    return accelerator


def shard_on_cpu(accelerator, plugin=None) -> None:
    """accelerate turns FSDP on for accelerators only and drops the plugin of a CPU run with several processes;
    its FSDP2 code runs on CPU over gloo as it is, so hand it the plugin, for the whole run: `prepare`, the
    accumulation steps' `no_sync` and the gradient clipping then take the same paths as on GPUs. Idempotent."""
    from accelerate.state import PartialState
    from accelerate.utils import DistributedType

    state = accelerator.state
    if state.distributed_type == DistributedType.MULTI_CPU:
        if plugin is not None:
            state.fsdp_plugin = plugin
        state.distributed_type = DistributedType.FSDP
        # each new AcceleratorState() (accelerate makes them as it goes) copies the process state's type over its
        # own: set it there as well, or the run turns back to plain multi-process at the next one
        PartialState._shared_state["distributed_type"] = DistributedType.FSDP


def unshard_on_cpu() -> None:
    """Undo `shard_on_cpu` for the next run in this process: plain multi-process again."""
    from accelerate.state import AcceleratorState, PartialState
    from accelerate.utils import DistributedType

    shared = PartialState._shared_state
    if shared.get("distributed_type") == DistributedType.FSDP and getattr(shared.get("device"), "type", None) == "cpu":
        shared["distributed_type"] = DistributedType.MULTI_CPU
        if AcceleratorState._shared_state:
            AcceleratorState._shared_state["distributed_type"] = DistributedType.MULTI_CPU


def fsdp_plugin(training: TrainingSection):
    """accelerate's FSDP2 plugin: one shard group per decoder block (the model's `_no_split_modules`), one
    for the embeddings and one for the final norm and output layer, the rest at the root.

    Fixed here, whatever `accelerate config` says: every process builds the whole model before sharding
    (no rank-0-only loading onto the meta device, which would leave the unsharded controller empty), no
    CPU offload, and no activation checkpointing by accelerate (`training.gradient_checkpointing` does it,
    non-reentrant as the controller needs). `reshard_after_forward` still comes from the accelerate config."""
    from accelerate.utils import FullyShardedDataParallelPlugin
    from torch.distributed.fsdp import MixedPrecisionPolicy

    mixed_precision = None
    if training.mixed_precision in LOW_PRECISION:
        # compute in the low precision (what autocast does under DDP); reduce the adapter's gradients in
        # float32, as DDP does: they are few, and they update float32 weights
        mixed_precision = MixedPrecisionPolicy(param_dtype=LOW_PRECISION[training.mixed_precision],
                                               reduce_dtype=torch.float32)
    return FullyShardedDataParallelPlugin(fsdp_version=2, auto_wrap_policy="transformer_based_wrap",
                                          mixed_precision_policy=mixed_precision, cpu_ram_efficient_loading=False,
                                          cpu_offload=False, activation_checkpointing=False)


def is_sharded(accelerator) -> bool:
    return bool(accelerator.is_fsdp2)


def keep_whole(accelerator, modules: Sequence[nn.Module]) -> list[nn.Parameter]:
    """Leave `modules` unsharded under FSDP (moved to the device here, as FSDP moves what it shards);
    returns their trainable parameters, whose gradients `average_gradients` must reduce."""
    modules = list(modules)
    for module in modules:
        module.to(accelerator.device)
    accelerator.state.fsdp_plugin.ignored_modules = modules
    return [p for module in modules for p in module.parameters() if p.requires_grad]


def average_gradients(params: Sequence[nn.Parameter], world_size: int) -> None:
    """Average the gradients of parameters FSDP does not manage over the processes, in one all-reduce.
    Every process runs the same model code, so the same parameters have gradients on each."""
    import torch.distributed as dist

    grads = [p.grad for p in params if p.grad is not None]
    if not grads or world_size == 1:
        return
    flat = torch.cat([g.reshape(-1).float() for g in grads])
    dist.all_reduce(flat)  # a sum: gloo has no average
    flat /= world_size
    offset = 0
    for grad in grads:
        grad.copy_(flat[offset:offset + grad.numel()].view_as(grad))
        offset += grad.numel()


def clip_grad_norm(params: Sequence[nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` (the 2-norm) over FSDP's sharded gradients and the whole ones of what
    FSDP leaves whole, on plain tensors: each process's shards' squared norms summed over the processes in one
    all-reduce, the whole gradients (equal on every process once averaged) counted once. The same total norm and
    scaling as the sharded tensors' own clipping, at a fraction of its host time (its dispatch runs once per
    multi-tensor operation and tensor kind). Returns the total norm."""
    import torch.distributed as dist

    dtensor = _dtensor_class()
    shards, whole = [], []
    with torch.no_grad():
        for param in params:
            grad = param.grad
            if grad is None:
                continue
            if dtensor is not None and isinstance(grad, dtensor):
                shards.append(grad.to_local())
            else:
                whole.append(grad)
        grads = shards + whole
        if not grads:
            return torch.zeros(())
        device = grads[0].device

        def squared(tensors: list[torch.Tensor]) -> torch.Tensor:
            if not tensors:
                return torch.zeros((), device=device, dtype=torch.float32)
            norms = torch._foreach_norm(tensors, 2.0)
            return torch.stack([n.to(device=device, dtype=torch.float32) for n in norms]).square().sum()

        total = squared(shards)
        if shards and dist.is_available() and dist.is_initialized():
            dist.all_reduce(total)  # each process holds other rows of the sharded gradients
        total = (total + squared(whole)).sqrt()
        # as torch clips: scale by max_norm / (norm + 1e-6) where that is below one, on the device (no sync)
        coefficient = (max_norm / (total + 1e-6)).clamp(max=1.0)
        by_kind: dict[tuple, list[torch.Tensor]] = {}
        for grad in grads:
            by_kind.setdefault((grad.device, grad.dtype), []).append(grad)
        for (kind_device, kind_dtype), group in by_kind.items():
            torch._foreach_mul_(group, coefficient.to(device=kind_device, dtype=kind_dtype))
    return total


def forget_kept_transposes(model: nn.Module) -> None:
    """Drop each BEM layer's kept V^T (the inference kernels' copy, kept until V's version counter or
    address changes). FSDP refills a gathered weight in place without bumping its version, at an address
    the allocator may well hand out again, so a copy kept at one evaluation could be read at the next,
    after optimizer steps. Within one evaluation the weights do not change, and the copy stays good."""
    from ..kernels.ops import TransposeKeeper

    for _, module in model.bem_modules():
        if isinstance(getattr(module, "_v_t", None), TransposeKeeper):
            module._v_t = TransposeKeeper()


# ---------------------------------------------------------------------- sharded <-> full tensors
def _dtensor_class() -> Optional[type]:
    try:
        from torch.distributed.tensor import DTensor
    except ImportError:  # a torch without distributed support has no sharded tensors either
        return None
    return DTensor


def full_tensors(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`state` with each sharded tensor gathered whole (a collective: every process calls it, in the same order)."""
    dtensor = _dtensor_class()
    if dtensor is None:
        return dict(state)
    return {key: value.full_tensor() if isinstance(value, dtensor) else value for key, value in state.items()}


def sharded_like(full: dict[str, torch.Tensor], reference: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`full` with each tensor cut into this process's shard wherever `reference` holds a sharded tensor
    under the same name (every process holds the full tensor, so no communication)."""
    from torch.distributed.tensor import distribute_tensor

    dtensor = _dtensor_class()
    result = {}
    for key, value in full.items():
        like = reference.get(key)
        if dtensor is not None and isinstance(like, dtensor) and not isinstance(value, dtensor):
            value = distribute_tensor(value.to(device=like.device, dtype=like.dtype), like.device_mesh,
                                      like.placements, src_data_rank=None)
        result[key] = value
    return result


@contextlib.contextmanager
def adapter_state_override(model: nn.Module, state: dict[str, torch.Tensor]) -> Iterator[None]:
    """Inside the block `model.bem_state_dict()` returns `state`: `save_pretrained` then writes these full
    tensors instead of this process's shards."""
    model.__dict__["bem_state_dict"] = lambda: state
    try:
        yield
    finally:
        del model.__dict__["bem_state_dict"]


def local_shards(optimizer_state: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """An optimizer state dict with this process's shard of each sharded tensor, and the names
    (`<param id>.<name>`) of those tensors."""
    dtensor = _dtensor_class()
    sharded: list[str] = []
    state: dict[int, dict[str, Any]] = {}
    for param_id, param_state in optimizer_state["state"].items():
        state[param_id] = {}
        for name, value in param_state.items():
            if dtensor is not None and isinstance(value, dtensor):
                value = value.to_local()
                sharded.append(f"{param_id}.{name}")
            state[param_id][name] = value
    return {"state": state, "param_groups": optimizer_state["param_groups"]}, sharded


def reshard_optimizer_state(optimizer_state: dict[str, Any], sharded: Sequence[str],
                            params: Sequence[nn.Parameter]) -> dict[str, Any]:
    """The inverse of `local_shards`: wrap each listed local tensor as a shard of the parameter it belongs to
    (`params` in the optimizer's order, which is what the ids count)."""
    from torch.distributed.tensor import DTensor

    names = set(sharded)
    state: dict[int, dict[str, Any]] = {}
    for param_id, param_state in optimizer_state["state"].items():
        param = params[int(param_id)]
        state[param_id] = {}
        for name, value in param_state.items():
            if f"{param_id}.{name}" in names:
                if not isinstance(param, DTensor):
                    raise ValueError(f"optimizer state {param_id}.{name} was saved sharded, but parameter "
                                     f"{param_id} of this run is not sharded; resume with training.distributed=fsdp")
                value = DTensor.from_local(value.to(param.device), param.device_mesh, param.placements,
                                           shape=param.shape, stride=param.stride())
            state[param_id][name] = value
    return {"state": state, "param_groups": optimizer_state["param_groups"]}


def optimizer_parameters(optimizer: torch.optim.Optimizer) -> list[nn.Parameter]:
    """The optimizer's parameters in its state dict's numbering (param groups in order)."""
    return [p for group in optimizer.param_groups for p in group["params"]]
