"""Training data: read local records, tokenize them (prompt tokens masked out of the loss), pack, batch.

A record is a mapping with a text field, or a prompt and a response field. Examples are plain lists of
token ids with aligned labels (-100 where no loss is taken); the model shifts labels itself.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence, Union

import torch

from .schema import ConfigError, DataSection

IGNORE_INDEX = -100


@dataclass
class Example:
    input_ids: list[int]
    labels: list[int]


def read_records(source: Union[str, Sequence[str]], key: str, split: str = "train") -> list[dict[str, Any]]:
    """All records of one file, several files or a saved `datasets` directory, in order."""
    paths = [source] if isinstance(source, str) else list(source)
    records: list[dict[str, Any]] = []
    for path in map(Path, paths):
        if path.is_dir():
            records.extend(_read_datasets_dir(path, key, split))
        elif path.suffix == ".jsonl":
            records.extend(_read_jsonl(path))
        elif path.suffix == ".json":
            data = json.loads(path.read_text(encoding="utf-8"))
            if not isinstance(data, list) or not all(isinstance(r, dict) for r in data):
                raise ConfigError(key, f"{path} must hold a JSON list of objects")
            records.extend(data)
        else:  # .txt: one document per non-empty line
            lines = path.read_text(encoding="utf-8").splitlines()
            records.extend({"text": line} for line in lines if line.strip())
    if not records:
        raise ConfigError(key, f"no records in {', '.join(paths)}")
    return records


def _read_jsonl(path: Path) -> Iterator[dict[str, Any]]:
    with path.open(encoding="utf-8") as handle:
        for number, line in enumerate(handle, 1):
            if not line.strip():
                continue
            try:
                record = json.loads(line)
            except json.JSONDecodeError as err:
                raise ConfigError("data", f"{path}:{number} is not valid JSON ({err.msg})") from None
            if not isinstance(record, dict):
                raise ConfigError("data", f"{path}:{number} is not a JSON object")
            yield record


def _read_datasets_dir(path: Path, key: str, split: str) -> list[dict[str, Any]]:
    try:
        import datasets
    except ImportError:
        raise ConfigError(key, f"{path} is a datasets directory but the datasets package is not installed") from None
    loaded = datasets.load_from_disk(str(path))
    if isinstance(loaded, datasets.DatasetDict):
        if split not in loaded:
            raise ConfigError("data.dataset_split", f"split '{split}' not in {path} (has {', '.join(loaded)})")
        loaded = loaded[split]
    return [dict(row) for row in loaded]


def detect_format(records: list[dict[str, Any]], data: DataSection) -> str:
    if data.format != "auto":
        return data.format
    first = records[0]
    if data.prompt_field in first and data.response_field in first:
        return "prompt_response"
    if data.text_field in first:
        return "text"
    raise ConfigError("data.format", f"records have fields {sorted(first)}, but neither '{data.text_field}' "
                                     f"(data.text_field) nor '{data.prompt_field}'/'{data.response_field}' "
                                     f"(data.prompt_field/response_field)")


def tokenize_records(records: list[dict[str, Any]], tokenizer, data: DataSection) -> list[Example]:
    """Tokenize, truncate to `max_length` (unless packing) and drop examples left without a target token."""
    kind = detect_format(records, data)
    eos = [tokenizer.eos_token_id] if data.add_eos and tokenizer.eos_token_id is not None else []
    examples = []
    for index, record in enumerate(records):
        if kind == "text":
            ids = _field(record, data.text_field, index, tokenizer, special=True) + eos
            labels = list(ids)
        else:
            prompt = _field(record, data.prompt_field, index, tokenizer, special=True)
            response = _field(record, data.response_field, index, tokenizer, special=False) + eos
            ids = prompt + response
            labels = [IGNORE_INDEX] * len(prompt) + response
        if not data.packing:
            ids, labels = ids[: data.max_length], labels[: data.max_length]
        # a label at position 0 is never predicted (nothing precedes it)
        if any(label != IGNORE_INDEX for label in labels[1:]):
            examples.append(Example(ids, labels))
    if not examples:
        raise ConfigError("data.max_length", "no example keeps a target token after truncation")
    return pack(examples, data.max_length) if data.packing else examples


def _field(record: dict[str, Any], name: str, index: int, tokenizer, special: bool) -> list[int]:
    value = record.get(name)
    if not isinstance(value, str):
        raise ConfigError("data", f"record {index} has no string field '{name}' (fields: {sorted(record)})")
    return list(tokenizer(value, add_special_tokens=special)["input_ids"])


def pack(examples: list[Example], block: int) -> list[Example]:
    """Concatenate every example and cut the stream into blocks of `block` tokens (the last may be shorter).

    Attention runs across example boundaries inside a block; the eos between examples marks them.
    """
    ids = [token for example in examples for token in example.input_ids]
    labels = [label for example in examples for label in example.labels]
    blocks = [Example(ids[i:i + block], labels[i:i + block]) for i in range(0, len(ids), block)]
    return [b for b in blocks if any(label != IGNORE_INDEX for label in b.labels[1:])]


def split_examples(examples: list[Example], fraction: float, seed: int) -> tuple[list[Example], list[Example]]:
    """A seeded held-out split: (train, eval); at least one eval example when `fraction` > 0."""
    if fraction <= 0:
        return examples, []
    order = torch.randperm(len(examples), generator=torch.Generator().manual_seed(seed)).tolist()
    count = max(1, round(len(examples) * fraction))
    if count >= len(examples):
        raise ConfigError("data.eval_fraction", f"leaves no training example out of {len(examples)}")
    held = set(order[:count])
    return [e for i, e in enumerate(examples) if i not in held], [examples[i] for i in sorted(held)]


class Collator:
    """Right-pads a list of examples into `input_ids`, `attention_mask` and `labels` tensors.

    Widths are rounded up to a multiple of `pad_to_multiple_of`: fewer distinct shapes means fewer
    kernel selections and allocator misses (CPU oneDNN primitives, GPU matmul tiles).
    """

    def __init__(self, pad_token_id: int, pad_to_multiple_of: int = 16) -> None:
        self.pad_token_id = pad_token_id
        self.pad_to_multiple_of = pad_to_multiple_of

    def __call__(self, batch: list[Example]) -> dict[str, torch.Tensor]:
        width = max(len(e.input_ids) for e in batch)
        width = -(-width // self.pad_to_multiple_of) * self.pad_to_multiple_of
        input_ids = torch.full((len(batch), width), self.pad_token_id, dtype=torch.long)
        labels = torch.full((len(batch), width), IGNORE_INDEX, dtype=torch.long)
        attention_mask = torch.zeros((len(batch), width), dtype=torch.long)
        for row, example in enumerate(batch):
            n = len(example.input_ids)
            input_ids[row, :n] = torch.tensor(example.input_ids)
            labels[row, :n] = torch.tensor(example.labels)
            attention_mask[row, :n] = 1
        return {"input_ids": input_ids, "attention_mask": attention_mask, "labels": labels}


class EpochSampler(torch.utils.data.Sampler[int]):
    """A shuffle that depends only on (seed, epoch): resuming at any epoch sees the same order."""

    def __init__(self, size: int, seed: int, shuffle: bool = True) -> None:
        self.size, self.seed, self.shuffle = size, seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self) -> Iterator[int]:
        if not self.shuffle:
            return iter(range(self.size))
        generator = torch.Generator().manual_seed(self.seed + self.epoch)
        return iter(torch.randperm(self.size, generator=generator).tolist())

    def __len__(self) -> int:
        return self.size


def target_token_count(labels: torch.Tensor) -> torch.Tensor:
    """How many positions a causal LM is scored on: labels after the one-token shift that are not ignored."""
    return (labels[:, 1:] != IGNORE_INDEX).sum()
