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
