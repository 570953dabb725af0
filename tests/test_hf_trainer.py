"""A BEMModel trains under transformers' Trainer as a PEFT model does: its forward names the base
model's arguments, so the Trainer keeps the batch's keys; BEMTrainer's checkpoints hold the adapter."""

from __future__ import annotations

import copy
import dataclasses
import inspect

import pytest
import torch
from transformers import Trainer, TrainingArguments

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from bem.training.hf_trainer import BEMTrainer

from conftest import random_ids


class _Batches(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict:
        ids = random_ids(1, 12, seed=index)[0]
        return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}


def test_forward_shows_the_base_models_arguments(load_base):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    names = list(inspect.signature(model.forward).parameters)
    assert names[:3] == list(inspect.signature(model.base_model.forward).parameters)[:3]
    assert {"input_ids", "attention_mask", "labels", "side_signals"} <= set(names)
    ids = random_ids(2, 7)
    assert torch.equal(model(ids).logits, model(input_ids=ids).logits)  # positional, as the base takes it


def test_a_deep_copy_after_a_training_forward_is_its_own_model(load_base):
    """As TRL makes its reference model: the copy calls its own modules, and the last forward's codes
    (graph tensors, which deepcopy refuses) are not copied."""
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    ids = random_ids(2, 7)
    expected = model(input_ids=ids).logits
    assert expected.requires_grad
    twin = copy.deepcopy(model)
    assert twin.forward.__self__ is twin
    with torch.no_grad():
        twin.bem_modules()[0][1].bem_U.normal_()
    assert torch.equal(model(input_ids=ids).logits, expected)
    assert not torch.allclose(twin(input_ids=ids).logits, expected)


@pytest.mark.parametrize("checkpointing", [False, True])
def test_trainer_updates_bem_and_leaves_the_base_frozen(checkpointing, load_base, tmp_path):
    torch.manual_seed(0)
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    before = {name: p.detach().clone() for name, p in model.named_parameters()}
    # transformers 5.24 renamed the argument (the old name warns)
    names = {f.name for f in dataclasses.fields(TrainingArguments)}
    keyword = "activation_checkpointing" if "activation_checkpointing" in names else "gradient_checkpointing"
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, **{keyword: checkpointing})
    trainer = Trainer(model=model, args=args, train_dataset=_Batches(), eval_dataset=_Batches())
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    on = getattr(model.base_model, "is_activation_checkpointing", None)
    assert (on if on is not None else model.base_model.is_gradient_checkpointing) == checkpointing
    assert trainer.label_names == ["labels"]  # read from BEMModel's forward, as from the base model's
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable
    assert any(".bem_U" in name for name in changed)


def _args(tmp_path, **overrides) -> TrainingArguments:
    options = dict(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, save_steps=2,
                   learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True, seed=7)
    options.update(overrides)
    return TrainingArguments(**options)


def _bem_weights(model) -> dict:
    return {name: value.clone() for name, value in model.bem_state_dict().items()}


@pytest.mark.parametrize("arch", ["llama", "gpt2"])  # gpt2 ties its embeddings: a whole state dict fails
def test_bem_trainer_checkpoints_hold_the_adapter(arch, load_base, tmp_path):
    torch.manual_seed(1)
    model = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(rank=4))
    BEMTrainer(model=model, args=_args(tmp_path), train_dataset=_Batches()).train()
    assert sorted(p.name for p in (tmp_path / "checkpoint-4").glob("*.safetensors")) == ["adapter_model.safetensors"]
    ids = random_ids(2, 9, seed=5)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        loaded = BEMModel.from_pretrained(load_base(arch), tmp_path / "checkpoint-4")
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        early = BEMModel.from_pretrained(load_base(arch), tmp_path / "checkpoint-2")
        assert not torch.equal(early(input_ids=ids).logits, expected)


def test_bem_trainer_resumes_where_it_stopped(load_base, tmp_path):
    torch.manual_seed(2)
    whole = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    start = _bem_weights(whole)
    BEMTrainer(model=whole, args=_args(tmp_path / "whole"), train_dataset=_Batches()).train()
    resumed = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    resumed.load_bem_state_dict(start)
    BEMTrainer(model=resumed, args=_args(tmp_path / "whole"), train_dataset=_Batches()).train(
        resume_from_checkpoint=str(tmp_path / "whole" / "checkpoint-2"))
    ends, again = _bem_weights(whole), _bem_weights(resumed)
    assert not torch.equal(ends["modules.model.layers.0.mlp.up_proj.U"], start["modules.model.layers.0.mlp.up_proj.U"])
    for name, value in ends.items():
        assert torch.allclose(again[name], value, atol=1e-6), name


def test_bem_trainer_loads_the_best_checkpoint_at_the_end(load_base, tmp_path):
    torch.manual_seed(3)
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    args = _args(tmp_path, max_steps=6, eval_strategy="steps", eval_steps=2, load_best_model_at_end=True,
                 metric_for_best_model="eval_loss", learning_rate=0.5)
    trainer = BEMTrainer(model=model, args=args, train_dataset=_Batches(), eval_dataset=_Batches())
    trainer.train()
    best = trainer.state.best_model_checkpoint
    assert best is not None
    best_model = BEMModel.from_pretrained(load_base("llama"), best)
    for name, value in best_model.bem_state_dict().items():
        assert torch.equal(model.bem_state_dict()[name], value), name


def test_a_plain_trainer_checkpoint_is_refused_with_the_way_out(load_base, tmp_path):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    Trainer(model=model, args=_args(tmp_path, max_steps=1, save_steps=1), train_dataset=_Batches()).train()
    with pytest.raises(FileNotFoundError, match="BEMTrainer"):
        BEMModel.from_pretrained(load_base("llama"), tmp_path / "checkpoint-1")
