"""A BEMModel trains under transformers' Trainer as a PEFT model does: its forward names the base
model's arguments, so the Trainer keeps the batch's keys; SaveBEMAdapterCallback puts the adapter in
each checkpoint."""

from __future__ import annotations

import copy
import inspect

import pytest
import torch
from transformers import Trainer, TrainerControl, TrainerState, TrainingArguments

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from bem.training.hf_callback import SaveBEMAdapterCallback

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
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4,
                             learning_rate=1e-2, save_strategy="no", report_to=[], use_cpu=True,
                             disable_tqdm=True, gradient_checkpointing=checkpointing)
    trainer = Trainer(model=model, args=args, train_dataset=_Batches(), eval_dataset=_Batches())
    result = trainer.train()
    assert result.global_step == 4 and torch.isfinite(torch.tensor(result.training_loss))
    assert trainer.label_names == ["labels"]  # read from BEMModel's forward, as from the base model's
    assert torch.isfinite(torch.tensor(trainer.evaluate()["eval_loss"]))
    changed = {name for name, p in model.named_parameters() if not torch.equal(p, before[name])}
    trainable = {name for name, p in model.named_parameters() if p.requires_grad}
    assert changed and changed <= trainable
    assert any(".bem_U" in name for name in changed)


def test_checkpoints_hold_the_adapter_with_the_callback(load_base, tmp_path):
    torch.manual_seed(1)
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=4, save_steps=2,
                             learning_rate=1e-2, report_to=[], use_cpu=True, disable_tqdm=True)
    trainer = Trainer(model=model, args=args, train_dataset=_Batches(), callbacks=[SaveBEMAdapterCallback()])
    trainer.train()
    ids = random_ids(2, 9, seed=5)
    model.eval()
    with torch.no_grad():
        expected = model(input_ids=ids).logits
        loaded = BEMModel.from_pretrained(load_base("llama"), tmp_path / "checkpoint-4")
        assert torch.equal(loaded(input_ids=ids).logits, expected)
        early = BEMModel.from_pretrained(load_base("llama"), tmp_path / "checkpoint-2")
        assert not torch.equal(early(input_ids=ids).logits, expected)


def test_a_trainer_checkpoint_without_the_adapter_is_refused_with_the_way_out(load_base, tmp_path):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4))
    args = TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=1, save_steps=1,
                             report_to=[], use_cpu=True, disable_tqdm=True)
    Trainer(model=model, args=args, train_dataset=_Batches()).train()
    with pytest.raises(FileNotFoundError, match="SaveBEMAdapterCallback"):
        BEMModel.from_pretrained(load_base("llama"), tmp_path / "checkpoint-1")


def test_the_callback_refuses_another_model(tmp_path):
    args = TrainingArguments(output_dir=str(tmp_path), report_to=[], use_cpu=True)
    with pytest.raises(TypeError, match="saves a BEMModel, but the Trainer's model is a Linear"):
        SaveBEMAdapterCallback().on_save(args, TrainerState(), TrainerControl(), model=torch.nn.Linear(2, 2))
