"""The training config's sections as dataclasses, and a checker that names the bad key.

Every section is a flat dataclass; its field annotations are the schema. `build_section` checks a raw
mapping (from YAML) against them: unknown keys (with the closest valid one), wrong types, bad choices.
Cross-field rules live in each section's `check()`.
"""

from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field
from typing import Any, Literal, Optional, Union

from ..config import closest_name
from ..quantization import QuantizationConfigError, check_quantization

# names other trainers use for the same keys, so a habit from elsewhere gets a useful hint
ALIASES = {"learning_rate": "lr", "num_epochs": "epochs", "num_train_epochs": "epochs",
           "per_device_train_batch_size": "batch_size", "train_batch_size": "batch_size",
           "grad_accum": "gradient_accumulation_steps", "lr_scheduler": "scheduler",
           "lr_scheduler_type": "scheduler", "warmup": "warmup_steps", "clip_grad_norm": "max_grad_norm",
           "grad_clip": "max_grad_norm", "fp16": "mixed_precision", "bf16": "mixed_precision",
           "save_steps": "save_every", "eval_steps": "eval_every", "logging_steps": "log_every",
           "resume_from_checkpoint": "resume", "model_name_or_path": "path", "torch_dtype": "dtype",
           "seq_len": "max_length", "max_seq_length": "max_length", "lora_r": "rank", "r": "rank",
           "lora_alpha": "alpha", "lora_dropout": "dropout", "fsdp": "distributed", "ddp": "distributed",
           "strategy": "distributed", "distributed_type": "distributed"}


def suggest(name: str, candidates) -> str:
    """' (did you mean 'x'?)' for a typo or a well-known alias of a valid key, else ''."""
    candidates = list(candidates)
    if ALIASES.get(name) in candidates:
        return f" (did you mean '{ALIASES[name]}'?)"
    return closest_name(name, candidates)


class ConfigError(ValueError):
    """A training config problem; the message starts with the dotted key it is about."""

    def __init__(self, key: str, message: str) -> None:
        super().__init__(f"{key}: {message}" if key else message)
        self.key = key


@dataclass
class ModelSection:
    path: Optional[str] = None  # local pretrained model directory (config.json + weights)
    architecture: Optional[str] = None  # build a fresh, randomly initialised model instead (see presets)
    size: str = "tiny"
    config_overrides: dict[str, Any] = field(default_factory=dict)  # HF config attributes for a fresh model
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    tokenizer: Optional[str] = None  # defaults to `path`; a byte-level tokenizer for fresh models
    attn_implementation: Optional[str] = None
    # a bitsandbytes base (bits 4 or 8, quant_type, compute_dtype, double_quant): bem/quantization.py
    quantization: Optional[dict[str, Any]] = None

    def check(self) -> None:
        try:
            self.quantization = check_quantization(self.quantization)
        except QuantizationConfigError as err:
            raise ConfigError(err.field, err.reason) from None
        if self.path is None and self.architecture is None:
            raise ConfigError("model", "set either 'path' (a local pretrained model) or 'architecture' (a fresh one)")
        if self.path is not None and self.architecture is not None:
            raise ConfigError("model.architecture", "give either 'path' or 'architecture', not both")
        if self.path is not None and self.config_overrides:
            raise ConfigError("model.config_overrides", "applies to fresh models ('architecture') only")


@dataclass
class DataSection:
    train: Union[str, list[str]] = ""  # jsonl/json/txt files, or a `datasets.save_to_disk` directory
    eval: Optional[Union[str, list[str]]] = None
    eval_fraction: float = 0.0  # held out of `train` when `eval` is not given
    format: Literal["auto", "text", "prompt_response"] = "auto"
    text_field: str = "text"
    prompt_field: str = "prompt"
    response_field: str = "response"
    max_length: int = 512
    packing: bool = False
    add_eos: bool = True
    dataset_split: str = "train"  # for a `datasets` DatasetDict directory

    def check(self) -> None:
        if not self.train:
            raise ConfigError("data.train", "is required: a data file, a list of files or a datasets directory")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise ConfigError("data.eval_fraction", f"must be in [0, 1), got {self.eval_fraction!r}")
        if self.eval is not None and self.eval_fraction > 0:
            raise ConfigError("data.eval_fraction", "give either 'eval' files or an 'eval_fraction', not both")
        _positive("data.max_length", self.max_length, minimum=2)


@dataclass
class TrainingSection:
    output_dir: str = "runs/bem"
    seed: int = 42
    lr: float = 1e-3
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    scheduler: Literal["constant", "linear", "cosine"] = "cosine"
    warmup_steps: int = 0
    epochs: int = 1
    max_steps: Optional[int] = None  # when set, wins over `epochs`
    batch_size: int = 8  # per device, per micro-step
    gradient_accumulation_steps: int = 1
    mixed_precision: Literal["no", "bf16", "fp16"] = "no"
    gradient_checkpointing: bool = False
    max_grad_norm: Optional[float] = 1.0
    eval_every: int = 0  # optimizer steps; 0: only after the last step
    eval_batch_size: Optional[int] = None
    save_every: int = 0  # optimizer steps; 0: only after the last step
    save_total_limit: Optional[int] = 2
    log_every: int = 10
    resume: Optional[str] = None  # "latest" or a checkpoint directory
    cpu: bool = False  # train on the CPU even when an accelerator is present
    # how several processes split the work: "ddp" replicates the model on each, "fsdp" shards it (FSDP2)
    distributed: Literal["ddp", "fsdp"] = "ddp"

    def check(self) -> None:
        for key in ("batch_size", "gradient_accumulation_steps", "epochs", "log_every"):
            _positive(f"training.{key}", getattr(self, key))
        for key in ("max_steps", "eval_batch_size", "save_total_limit"):
            if getattr(self, key) is not None:
                _positive(f"training.{key}", getattr(self, key))
        for key in ("warmup_steps", "eval_every", "save_every"):
            if getattr(self, key) < 0:
                raise ConfigError(f"training.{key}", f"must be >= 0, got {getattr(self, key)!r}")
        if self.lr <= 0:
            raise ConfigError("training.lr", f"must be > 0, got {self.lr!r}")
        if self.weight_decay < 0:
            raise ConfigError("training.weight_decay", f"must be >= 0, got {self.weight_decay!r}")
        for key in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, key) < 1.0:
                raise ConfigError(f"training.{key}", f"must be in [0, 1), got {getattr(self, key)!r}")
        if self.max_grad_norm is not None and self.max_grad_norm <= 0:
            raise ConfigError("training.max_grad_norm", f"must be > 0 or null, got {self.max_grad_norm!r}")
        if not self.output_dir:
            raise ConfigError("training.output_dir", "must not be empty")


@dataclass
class LoggingSection:
    console: bool = True  # progress bar with loss, lr and tokens/s
    metrics_file: Optional[str] = "metrics.jsonl"  # relative to training.output_dir; null: none
    tensorboard: bool = False  # event files under output_dir/tensorboard (needs the tensorboard package)
    routing_summary: bool = True  # print routing_stats() at every evaluation

    def check(self) -> None:
        pass


SECTIONS: dict[str, type] = {
    "model": ModelSection,
    "data": DataSection,
    "training": TrainingSection,
    "logging": LoggingSection,
}
# `bem` is the fourth section; it is checked against HierarchicalBEMConfig's own fields.
SECTION_NAMES = ("model", "bem", "data", "training", "logging")


def _positive(key: str, value: int, minimum: int = 1) -> None:
    if value < minimum:
        raise ConfigError(key, f"must be an integer >= {minimum}, got {value!r}")


def section_fields(cls: type) -> dict[str, Any]:
    """Field name -> resolved type annotation of a section dataclass."""
    hints = typing.get_type_hints(cls)
    return {f.name: hints[f.name] for f in dataclasses.fields(cls)}


def build_section(cls: type, raw: Any, prefix: str) -> Any:
    """Check `raw` against the dataclass `cls` and return an instance; errors name `prefix.key`."""
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError(prefix, f"must be a mapping of keys to values, got {_describe(raw)}")
    fields = section_fields(cls)
    values = {}
    for key, value in raw.items():
        if key not in fields:
            raise ConfigError(f"{prefix}.{key}", f"unknown key{suggest(str(key), fields)}")
        values[key] = coerce(value, fields[key], f"{prefix}.{key}")
    instance = cls(**values)
    instance.check()
    return instance


def coerce(value: Any, hint: Any, key: str) -> Any:
    """`value` if it fits the annotation `hint` (numbers given as strings such as '3e-4' become floats)."""
    origin = typing.get_origin(hint)
    args = typing.get_args(hint)
    if origin is Union:
        if value is None and type(None) in args:
            return None
        errors = []
        for option in (a for a in args if a is not type(None)):
            try:
                return coerce(value, option, key)
            except ConfigError as err:
                errors.append(err)
        raise ConfigError(key, f"expected {_type_name(hint)}, got {_describe(value)}")
    if origin is Literal:
        if value is False and "no" in args:
            return "no"  # YAML 1.1 reads a bare `no` as false
        if isinstance(value, bool) or value not in args:
            raise ConfigError(key, f"must be one of {', '.join(repr(a) for a in args)}, got {value!r}"
                                   f"{closest_name(str(value), [str(a) for a in args])}")
        return value
    if origin is list:
        if not isinstance(value, list):
            raise ConfigError(key, f"expected {_type_name(hint)}, got {_describe(value)}")
        return [coerce(item, args[0], f"{key}[{i}]") for i, item in enumerate(value)]
    if origin is dict:
        if not isinstance(value, dict):
            raise ConfigError(key, f"expected a mapping, got {_describe(value)}")
        return dict(value)
    if hint is bool:
        if not isinstance(value, bool):
            raise ConfigError(key, f"expected true or false, got {_describe(value)}")
        return value
    if hint is int:
        if isinstance(value, bool) or not isinstance(value, int):
            raise ConfigError(key, f"expected an integer, got {_describe(value)}")
        return value
    if hint is float:
        if isinstance(value, str):
            # YAML reads '3e-4' (no dot) as a string; accept any spelling float() accepts
            try:
                return float(value)
            except ValueError:
                pass
        if isinstance(value, bool) or not isinstance(value, (int, float)):
            raise ConfigError(key, f"expected a number, got {_describe(value)}")
        return float(value)
    if hint is str:
        if not isinstance(value, str):
            raise ConfigError(key, f"expected a string, got {_describe(value)}")
        return value
    if hint is Any:
        return value
    raise TypeError(f"unsupported schema annotation {hint!r} for {key}")


def _type_name(hint: Any) -> str:
    origin, args = typing.get_origin(hint), typing.get_args(hint)
    if origin is Union:
        return " or ".join(_type_name(a) for a in args if a is not type(None)) + (
            " or null" if type(None) in args else "")
    if origin is list:
        return f"a list of {_type_name(args[0])}s"
    return {bool: "true/false", int: "an integer", float: "a number", str: "a string"}.get(hint, str(hint))


def _describe(value: Any) -> str:
    if value is None:
        return "null"
    return f"{type(value).__name__} {value!r}"
