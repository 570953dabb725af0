"""`training.distributed` in one process: what the launcher asked for is respected, and `fsdp` with a single
process trains unsharded. (Two processes: tests/test_training_multiprocess.py.)"""

from __future__ import annotations

import pytest

from bem.training import ConfigError
from bem.training.distributed import USE_FSDP, fsdp_plugin, make_accelerator
from bem.training.schema import TrainingSection


def test_a_launcher_that_turned_fsdp_on_needs_the_config_to_say_so(monkeypatch):
    monkeypatch.setenv(USE_FSDP, "true")
    with pytest.raises(ConfigError, match="training.distributed=fsdp") as refused:
        make_accelerator(TrainingSection(cpu=True, distributed="ddp"))
    assert refused.value.key == "training.distributed"


def test_fsdp_in_one_process_is_unsharded_and_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv(USE_FSDP, raising=False)
    accelerator = make_accelerator(TrainingSection(cpu=True, distributed="fsdp"))
    assert accelerator.num_processes == 1 and not accelerator.is_fsdp2
    assert USE_FSDP not in __import__("os").environ  # a later run in this process may choose DDP


@pytest.mark.parametrize("precision, compute", [("no", None), ("bf16", "bfloat16"), ("fp16", "float16")])
def test_the_fsdp_plugin_shards_per_block_and_reduces_in_float32(precision, compute):
    import torch

    plugin = fsdp_plugin(TrainingSection(mixed_precision=precision, distributed="fsdp"))
    assert plugin.fsdp_version == 2
    assert plugin.cpu_ram_efficient_loading is False and plugin.activation_checkpointing is False
    policy = plugin.mixed_precision_policy
    if compute is None:
        assert policy is None
    else:
        assert policy.param_dtype == getattr(torch, compute) and policy.reduce_dtype == torch.float32


def test_kept_transposes_are_dropped_before_an_evaluation_under_fsdp():
    """FSDP refills a gathered V in place without bumping its version; a V^T kept from before would be read."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig

    from bem import HierarchicalBEMConfig, create_hierarchical_bem
    from bem.training.distributed import forget_kept_transposes

    base = AutoModelForCausalLM.from_config(LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64,
                                                        num_hidden_layers=1, num_attention_heads=4,
                                                        num_key_value_heads=2))
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=4))
    _, layer = model.bem_modules()[0]
    V = layer.bem_V
    kept = layer._v_t.get(V).clone()
    with torch.no_grad(), torch.autograd._unsafe_preserve_version_counter(V):
        V.add_(1.0)  # as an all-gather refills the weight: same address, same version
    assert torch.equal(layer._v_t.get(V), kept)  # the stale copy that must not be read
    forget_kept_transposes(model)
    assert torch.equal(layer._v_t.get(V), V.detach().t())


def _fsdp_then_ddp(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo processes: an FSDP accelerator, then a DDP one in the same process."""
    import json
    import os

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world),
                      LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    kinds = []
    for strategy in ("fsdp", "ddp"):
        accelerator = make_accelerator(TrainingSection(cpu=True, distributed=strategy))
        kinds.append([str(accelerator.distributed_type), bool(accelerator.is_fsdp2)])
    if rank == 0:
        with open(out, "w") as handle:
            json.dump(kinds, handle)


def test_a_ddp_run_after_an_fsdp_run_in_one_cpu_process_is_plain_ddp(tmp_path):
    """FSDP on CPU sets accelerate's process-wide state; the next run in the process must not inherit it."""
    import json
    import socket

    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    out = tmp_path / "kinds.json"
    mp.spawn(_fsdp_then_ddp, args=(2, port, str(out)), nprocs=2, join=True)
    (fsdp_kind, fsdp2), (ddp_kind, ddp_fsdp2) = json.loads(out.read_text())
    assert fsdp2 and fsdp_kind.endswith("FSDP")
    assert not ddp_fsdp2 and ddp_kind.endswith("MULTI_CPU")


def _clip_on_two_processes(rank: int, world: int, port: int, out: str) -> None:
    """One of two gloo processes: clip sharded and whole gradients with `clip_grad_norm`, and save the result."""
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Shard, distribute_tensor

    from bem.training.distributed import clip_grad_norm

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        mesh = init_device_mesh("cpu", (world,))
        full = _clip_case()
        params = []
        for index, grad in enumerate(full):
            if index < 3:  # sharded along the first dimension, one of them unevenly (7 rows over 2)
                param = torch.nn.Parameter(distribute_tensor(torch.zeros_like(grad), mesh, [Shard(0)]))
                param.grad = distribute_tensor(grad, mesh, [Shard(0)])
            else:  # left whole, as FSDP leaves the controller
                param = torch.nn.Parameter(torch.zeros_like(grad))
                param.grad = grad.clone()
            params.append(param)
        total = clip_grad_norm(params, 1.0)
        gathered = {f"g{i}": (p.grad.full_tensor() if i < 3 else p.grad) for i, p in enumerate(params)}
        if rank == 0:
            from safetensors.torch import save_file

            save_file({"total": total, **{k: v.contiguous() for k, v in gathered.items()}}, out)
    finally:
        dist.destroy_process_group()
    # Every result is saved: leave without the interpreter's teardown, in which gloo's threads aborted one of the two
    # processes about once in ten runs ("terminate called without an active exception", torch 2.13 on CPU).
    os._exit(0)


def _clip_case():
    import torch

    generator = torch.Generator().manual_seed(3)
    shapes = [(7, 3), (4, 5), (6,), (2, 3), ()]
    return [torch.randn(shape, generator=generator) for shape in shapes]


def test_clip_grad_norm_over_shards_equals_torch_over_the_whole_gradients(tmp_path):
    """Two processes: the sharded gradients' norm is summed over both, the whole ones counted once; the total
    norm and the clipped gradients equal torch's clipping of the full tensors in one process."""
    import socket

    import torch
    import torch.multiprocessing as mp

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]

    out = tmp_path / "clipped.safetensors"
    mp.spawn(_clip_on_two_processes, args=(2, port, str(out)), nprocs=2, join=True)
    from safetensors.torch import load_file

    result = load_file(out)
    expected = [torch.nn.Parameter(torch.zeros_like(g)) for g in _clip_case()]
    for param, grad in zip(expected, _clip_case()):
        param.grad = grad.clone()
    total = torch.nn.utils.clip_grad_norm_(expected, 1.0)
    assert total > 1.0  # the case clips
    torch.testing.assert_close(result["total"], total)
    for index, param in enumerate(expected):
        torch.testing.assert_close(result[f"g{index}"], param.grad)


def test_clip_grad_norm_in_one_process_is_torchs():
    import torch

    from bem.training.distributed import clip_grad_norm

    for max_norm in (0.5, 100.0):  # clipped, and left alone
        mine = [torch.nn.Parameter(torch.zeros_like(g)) for g in _clip_case()]
        theirs = [torch.nn.Parameter(torch.zeros_like(g)) for g in _clip_case()]
        for a, b, grad in zip(mine, theirs, _clip_case()):
            a.grad, b.grad = grad.clone(), grad.clone()
        mine[1].grad = None  # a parameter without a gradient is skipped, as torch skips it
        theirs[1].grad = None
        torch.testing.assert_close(clip_grad_norm(mine, max_norm), torch.nn.utils.clip_grad_norm_(theirs, max_norm))
        for a, b in zip(mine, theirs):
            assert (a.grad is None) == (b.grad is None)
            if a.grad is not None:
                torch.testing.assert_close(a.grad, b.grad)


def test_adamw_is_fused_on_cuda_only():
    import torch

    from bem.training.optim import build_optimizer, fused_on_cuda

    cpu = [torch.nn.Parameter(torch.zeros(2))]
    assert fused_on_cuda(cpu) == {} and fused_on_cuda([]) == {}
    assert build_optimizer(cpu, TrainingSection()).defaults["fused"] is None
    meta_cuda = torch.empty(2, device="meta")
    assert fused_on_cuda([meta_cuda]) == {}
    # the trainer builds its optimizer before accelerate moves the model: fused when it will be on a GPU
    assert fused_on_cuda(cpu, torch.device("cuda", 0)) == {"fused": True}
    assert fused_on_cuda(cpu, torch.device("cpu")) == {}
    assert fused_on_cuda([meta_cuda], torch.device("cuda")) == {}
    assert fused_on_cuda([torch.zeros(2, dtype=torch.long)], torch.device("cuda")) == {}
    assert build_optimizer(cpu, TrainingSection(), device=torch.device("cuda")).defaults["fused"] is True
