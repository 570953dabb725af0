"""modules_to_save: a classification head trained beside BEM, as PEFT's modules_to_save."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForSequenceClassification

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem

from conftest import TINY_CONFIGS, random_ids


def classifier_base(seed: int = 0):
    """A tiny BERT with a 3-way classification head; the same seed gives the same weights."""
    config = TINY_CONFIGS["bert"]()
    config.num_labels = 3
    torch.manual_seed(seed)
    return AutoModelForSequenceClassification.from_config(config).eval()


def logits(model, ids):
    with torch.no_grad():
        return model(input_ids=ids).logits


def train_steps(model, steps: int = 3) -> None:
    optimizer = torch.optim.SGD(model.adapter_parameters(), lr=0.5)
    model.train()
    for step in range(steps):
        ids = random_ids(4, 10, seed=step)
        loss = model(input_ids=ids, labels=torch.tensor([0, 1, 2, 1])).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
    model.eval()


def test_the_head_trains_as_a_copy_and_the_base_stays_exact(tmp_path):
    model = create_hierarchical_bem(classifier_base(), HierarchicalBEMConfig(rank=4, modules_to_save=["classifier"]))
    ids = random_ids(3, 9, seed=9)
    base_logits = logits(classifier_base(), ids)
    head = model.saved_modules()[0][1]
    assert model.saved_module_names == ["classifier"]
    assert all(p.requires_grad for p in head.trained.parameters())
    assert not any(p.requires_grad for p in head.original.parameters())
    train_steps(model)
    assert not torch.equal(head.trained.weight, head.original.weight)
    assert torch.equal(head.original.weight, classifier_base().classifier.weight)
    trained_logits = logits(model, ids)
    with model.disable_bem():
        assert torch.equal(logits(model, ids), base_logits)

    model.save_pretrained(tmp_path)
    loaded = BEMModel.from_pretrained(classifier_base(), tmp_path)
    assert torch.equal(logits(loaded, ids), trained_logits)
    resumed = BEMModel.from_pretrained(classifier_base(), tmp_path, is_trainable=True)
    assert all(p.requires_grad for p in resumed.saved_modules()[0][1].trained.parameters())
    assert torch.equal(logits(loaded.unload(), ids), base_logits)  # the original head is back


def test_merge_and_unload_keeps_the_trained_head():
    model = create_hierarchical_bem(classifier_base(), HierarchicalBEMConfig(
        rank=4, enable_routing=False, modules_to_save=["classifier"]))
    train_steps(model)
    ids = random_ids(2, 7, seed=3)
    expected = logits(model, ids)
    merged = model.merge_and_unload()
    assert type(merged.classifier).__name__ == "Linear"
    assert (logits(merged, ids) - expected).abs().max().item() < 1e-5


def test_peft_modules_to_save_move_both_ways(tmp_path):
    torch.manual_seed(5)
    lora = get_peft_model(classifier_base(), LoraConfig(r=4, target_modules=["query", "value"], task_type="SEQ_CLS",
                                                        init_lora_weights=False)).eval()
    with torch.no_grad():
        lora.base_model.model.classifier.modules_to_save["default"].weight.normal_()
    ids = random_ids(2, 8, seed=5)
    expected = logits(lora, ids)
    lora.save_pretrained(tmp_path / "peft")
    bem = BEMModel.from_peft_lora(classifier_base(), tmp_path / "peft", enable_routing=False)
    assert bem.saved_module_names == ["classifier"]
    assert (logits(bem, ids) - expected).abs().max().item() < 1e-5

    bem.save_as_peft_lora(tmp_path / "back")
    again = PeftModel.from_pretrained(classifier_base(), tmp_path / "back").eval()
    assert (logits(again, ids) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("names,message", [
    (["nowhere"], "matched no module"),
    (["encoder"], "holds BEM targets"),
])
def test_modules_to_save_errors_name_the_problem(names, message):
    with pytest.raises(ValueError, match=message):
        create_hierarchical_bem(classifier_base(), HierarchicalBEMConfig(rank=4, modules_to_save=names))


@pytest.mark.parametrize("value", ["classifier", [], [""], [3]])
def test_modules_to_save_must_be_a_list_of_names(value):
    with pytest.raises(ValueError, match="modules_to_save must be a non-empty list of module names"):
        HierarchicalBEMConfig(modules_to_save=value)


def test_a_classifier_without_its_head_saved_warns(recwarn):
    with pytest.warns(UserWarning, match=r"head \['classifier'\] stays frozen.*modules_to_save=\['classifier'\]"):
        create_hierarchical_bem(classifier_base(), HierarchicalBEMConfig(rank=4))
    recwarn.clear()
    create_hierarchical_bem(classifier_base(), HierarchicalBEMConfig(rank=4, modules_to_save=["classifier"]))
    assert not [w for w in recwarn if "stays frozen" in str(w.message)]


def test_a_peft_head_of_another_shape_is_refused_naming_it(tmp_path):
    lora = get_peft_model(classifier_base(), LoraConfig(r=4, target_modules=["query"], task_type="SEQ_CLS"))
    lora.save_pretrained(tmp_path)
    config = TINY_CONFIGS["bert"]()
    config.num_labels = 5
    other = AutoModelForSequenceClassification.from_config(config)
    with pytest.raises(ValueError, match=r"module to save 'classifier'.*\(3, \d+\).*\(5, \d+\)"):
        BEMModel.from_peft_lora(other, tmp_path, enable_routing=False)
    assert type(other.classifier).__name__ == "Linear"  # given back unwrapped
    assert not any(type(m).__name__ == "BEMLinear" for m in other.modules())
