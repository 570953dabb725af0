"""Data pipeline: prompt tokens out of the loss, truncation, packing, seeded split and epoch order."""

from __future__ import annotations

import json

import pytest

from bem.training.data import (IGNORE_INDEX, Collator, EpochSampler, pack, read_records, split_examples,
                               target_token_count, tokenize_records)
from bem.training.schema import ConfigError, DataSection
from bem.training.tokenizer import byte_level_tokenizer


@pytest.fixture(scope="module")
def tokenizer():
    return byte_level_tokenizer()


def test_byte_tokenizer_round_trips_text(tokenizer):
    text = "Q: Shout 'ünïcode'!\nA: OK"
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    assert len(ids) == len(text.encode("utf-8"))
    assert tokenizer.decode(ids) == text


def test_prompt_is_masked_out_of_the_loss(tokenizer):
    data = DataSection(train="x", max_length=64)
    [example] = tokenize_records([{"prompt": "Q: hi\nA:", "response": " yo"}], tokenizer, data)
    prompt_len = len("Q: hi\nA:".encode())
    assert example.labels[:prompt_len] == [IGNORE_INDEX] * prompt_len
    assert example.labels[prompt_len:] == example.input_ids[prompt_len:]
    assert example.input_ids[-1] == tokenizer.eos_token_id
    assert tokenizer.decode(example.input_ids[prompt_len:-1]) == " yo"


def test_text_format_trains_on_every_token_and_truncates(tokenizer):
    data = DataSection(train="x", max_length=8)
    [example] = tokenize_records([{"text": "abcdefghijkl"}], tokenizer, data)
    assert len(example.input_ids) == 8
    assert example.labels == example.input_ids


def test_examples_without_targets_after_truncation_are_dropped(tokenizer):
    data = DataSection(train="x", max_length=4)
    records = [{"prompt": "a long prompt", "response": "r"}, {"prompt": "a", "response": "bcd"}]
    examples = tokenize_records(records, tokenizer, data)
    assert len(examples) == 1
    with pytest.raises(ConfigError, match="data.max_length"):
        tokenize_records(records[:1], tokenizer, data)


def test_packing_keeps_every_token_and_the_masks(tokenizer):
    data = DataSection(train="x", max_length=16, packing=True)
    records = [{"prompt": f"p{i}:", "response": f" answer {i}"} for i in range(10)]
    unpacked = tokenize_records(records, tokenizer, DataSection(train="x", max_length=1000))
    packed = tokenize_records(records, tokenizer, data)
    assert all(len(b.input_ids) <= 16 for b in packed)
    assert [t for b in packed for t in b.input_ids] == [t for e in unpacked for t in e.input_ids]
    assert [t for b in packed for t in b.labels] == [t for e in unpacked for t in e.labels]


def test_auto_format_and_missing_fields(tokenizer):
    data = DataSection(train="x")
    with pytest.raises(ConfigError, match="neither 'text'"):
        tokenize_records([{"question": "q"}], tokenizer, data)
    with pytest.raises(ConfigError, match="record 1 has no string field 'response'"):
        tokenize_records([{"prompt": "a", "response": "b"}, {"prompt": "c"}], tokenizer, data)


def test_read_records_reports_file_and_line(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps({"text": "ok"}) + "\n{broken\n")
    with pytest.raises(ConfigError, match="d.jsonl:2"):
        read_records(str(path), "data.train")
    txt = tmp_path / "d.txt"
    txt.write_text("one\n\ntwo\n")
    assert read_records([str(txt)], "data.train") == [{"text": "one"}, {"text": "two"}]


def test_split_is_seeded_and_disjoint(tokenizer):
    examples = tokenize_records([{"text": f"doc {i}"} for i in range(50)], tokenizer, DataSection(train="x"))
    train_a, eval_a = split_examples(examples, 0.2, seed=3)
    train_b, eval_b = split_examples(examples, 0.2, seed=3)
    _, eval_c = split_examples(examples, 0.2, seed=4)
    assert len(eval_a) == 10 and len(train_a) == 40
    assert [e.input_ids for e in eval_a] == [e.input_ids for e in eval_b]
    assert [e.input_ids for e in eval_a] != [e.input_ids for e in eval_c]
    assert not {tuple(e.input_ids) for e in eval_a} & {tuple(e.input_ids) for e in train_a}


def test_epoch_sampler_depends_only_on_seed_and_epoch():
    sampler = EpochSampler(20, seed=5)
    sampler.set_epoch(1)
    first = list(sampler)
    sampler.set_epoch(0)
    other_epoch = list(sampler)
    again = EpochSampler(20, seed=5)
    again.set_epoch(1)
    assert list(again) == first
    assert first != other_epoch
    assert sorted(first) == list(range(20))


def test_collator_pads_right_and_counts_targets(tokenizer):
    examples = tokenize_records([{"prompt": "ab", "response": "c"}], tokenizer, DataSection(train="x"))
    examples += tokenize_records([{"text": "hello"}], tokenizer, DataSection(train="x"))
    batch = Collator(tokenizer.pad_token_id, pad_to_multiple_of=1)(examples)
    assert batch["input_ids"].shape == (2, 6)
    assert Collator(tokenizer.pad_token_id, pad_to_multiple_of=8)(examples)["input_ids"].shape == (2, 8)
    assert batch["attention_mask"].sum(1).tolist() == [4, 6]
    assert (batch["labels"][0, 4:] == IGNORE_INDEX).all()
    # targets: row 0 predicts "c" and eos; row 1 predicts 5 of its 6 tokens
    assert int(target_token_count(batch["labels"])) == 2 + 5
