"""`ProfileConfig`: what to profile and how, read from YAML and validated before anything runs.

Every section is a small dataclass; unknown keys are rejected with the closest valid name, bad values
with the dotted path of the field (`decode.batch_sizes`). The defaults are the tiny CPU profile that
`configs/profile_tiny.yaml` spells out.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml

from ..config import MIXERS, HierarchicalBEMConfig, closest_name
from ..quantization import QuantizationConfigError, check_quantization
from .statistics import repeats_needed

DTYPES = ("float32", "float16", "bfloat16")
DEVICES = ("auto", "cpu", "cuda")
KINDS = ("prefill", "decode", "decode_compiled", "train")
COMPILE_BACKENDS = ("inductor", "aot_eager", "eager")
ATTENTION = ("eager", "sdpa")


class ProfileConfigError(ValueError):
    """A profile config (file, key or value) that cannot be used; the CLI exits 2 on it."""


def _tiny_llama() -> dict[str, Any]:
    return {
        "model_type": "llama", "vocab_size": 512, "hidden_size": 128, "intermediate_size": 344,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "max_position_embeddings": 512, "pad_token_id": 0, "bos_token_id": 1, "eos_token_id": 2,
    }


@dataclass
class ModelSpec:
    """The base model: a local Hugging Face directory (`path`) or a config built with random weights."""

    path: Optional[str] = None
    config: Optional[dict[str, Any]] = field(default_factory=_tiny_llama)
    dtype: str = "float32"
    attn_implementation: str = "eager"
    # a bitsandbytes base (bits 4 or 8, quant_type, compute_dtype, double_quant): bem/quantization.py
    quantization: Optional[dict[str, Any]] = None


@dataclass
class PrefillSpec:
    shapes: list[list[int]] = field(default_factory=lambda: [[1, 32], [4, 64]])  # (batch, sequence) pairs


@dataclass
class DecodeSpec:
    batch_sizes: list[int] = field(default_factory=lambda: [1, 4])
    prompt_length: int = 8
    new_tokens: int = 8
    # also time decoding as transformers' fast path runs it: a static cache, whose decoding step generate
    # compiles (mode reduce-overhead: CUDA graphs on a GPU)
    compiled: bool = False
    compile_backend: str = "inductor"
    eager: bool = True  # false: only the compiled setting


@dataclass
class TrainSpec:
    enabled: bool = True
    batch_size: int = 2
    sequence_length: int = 64
    learning_rate: float = 1e-4


@dataclass
class TimingSpec:
    """Untimed rounds, then timed repeats until BEM over base's interval is within ±target_spread, between
    min_repeats and max_repeats, and for at most max_seconds of timed repeats per setting."""

    warmup: int = 1
    min_repeats: int = 5
    max_repeats: int = 20
    target_spread: float = 0.05
    max_seconds: float = 3.0
    confidence: float = 0.9  # of the order-statistic interval for the median per-repeat ratio
    gpu_warmup_seconds: float = 1.0


@dataclass
class KernelSpec:
    """Shapes for `--kernels`: [tokens, in_features, out_features, rank] rows."""

    shapes: list[list[int]] = field(default_factory=lambda: [[16, 256, 256, 8], [512, 256, 1024, 8]])
    dtype: str = "float32"
    run_with_profile: bool = False


@dataclass
class ProfileConfig:
    name: str = "tiny"
    device: str = "auto"
    seed: int = 0
    threads: Optional[int] = None
    model: ModelSpec = field(default_factory=ModelSpec)
    bem: dict[str, Any] = field(default_factory=lambda: {
        "rank": 8, "alpha": 16.0, "attach_mlp": True, "attach_attention": True, "attach_qkv": True})
    lora: bool = True
    # mixer settings: the prefill and eager decoding settings again with BEM plus each mixer kind listed here
    # (HierarchicalBEMConfig's mixer_* fields from `bem`); informative rows, never gated (a mixer is a layer
    # added on purpose, not overhead)
    mixers: list[str] = field(default_factory=list)
    prefill: PrefillSpec = field(default_factory=PrefillSpec)
    decode: DecodeSpec = field(default_factory=DecodeSpec)
    train: TrainSpec = field(default_factory=TrainSpec)
    timing: TimingSpec = field(default_factory=TimingSpec)
    kernels: KernelSpec = field(default_factory=KernelSpec)
    max_overhead: float = 0.15
    gate: list[str] = field(default_factory=lambda: list(KINDS))
    output_dir: str = "outputs/profile"

    def __post_init__(self) -> None:
        validate(self)

    def bem_config(self, mixer: Optional[str] = None) -> HierarchicalBEMConfig:
        fields = dict(self.bem)
        if mixer is not None:
            fields["mixer"] = mixer
        return HierarchicalBEMConfig.from_dict(fields)

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# ---------------------------------------------------------------------- loading
def load_profile_config(path: Union[str, Path]) -> ProfileConfig:
    """Read and validate a YAML profile config; every problem is a `ProfileConfigError`."""
    path = Path(path)
    if not path.is_file():
        raise ProfileConfigError(f"config file not found: {path}")
    try:
        data = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ProfileConfigError(f"{path} is not valid YAML: {err}") from None
    return profile_config_from_dict(data, source=str(path))


def profile_config_from_dict(data: Any, source: str = "config") -> ProfileConfig:
    try:
        return _build(ProfileConfig, data, prefix="")
    except ProfileConfigError as err:
        raise ProfileConfigError(f"{source}: {err}") from None


def _build(cls: type, data: Any, prefix: str) -> Any:
    where = prefix.rstrip(".") or "the top level"
    if not isinstance(data, dict):
        raise ProfileConfigError(f"{where} must be a mapping, got {type(data).__name__}")
    specs = {f.name: f for f in dataclasses.fields(cls)}
    values = {}
    for key, value in data.items():
        if key not in specs:
            hint = closest_name(str(key), specs).replace(" '", f" '{prefix}", 1)
            raise ProfileConfigError(f"unknown key '{prefix}{key}'{hint}")
        nested = _SECTIONS.get(specs[key].type) if isinstance(specs[key].type, str) else None
        values[key] = _build(nested, value, f"{prefix}{key}.") if nested is not None else value
    if cls is ModelSpec and values.get("path") is not None and "config" not in values:
        values["config"] = None  # a local model replaces the default random-weight config
    return cls(**values)


_SECTIONS = {"ModelSpec": ModelSpec, "PrefillSpec": PrefillSpec, "DecodeSpec": DecodeSpec,
             "TrainSpec": TrainSpec, "TimingSpec": TimingSpec, "KernelSpec": KernelSpec}


# ---------------------------------------------------------------------- validation
def _positive_int(name: str, value: Any, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ProfileConfigError(f"{name} must be an integer >= {minimum}, got {value!r}")


def _choice(name: str, value: Any, choices: tuple[str, ...]) -> None:
    if value not in choices:
        hint = closest_name(str(value), choices)
        raise ProfileConfigError(f"{name} must be one of {', '.join(choices)}; got {value!r}{hint}")


def _number(name: str, value: Any, low: float, high: float = math.inf) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ProfileConfigError(f"{name} must be a finite number, got {value!r}")
    if not low <= value <= high:
        raise ProfileConfigError(f"{name} must be in [{low}, {high}], got {value!r}")


def _int_rows(name: str, rows: Any, width: int, allow_empty: bool = True) -> None:
    if not isinstance(rows, list) or (not rows and not allow_empty):
        raise ProfileConfigError(f"{name} must be a list of [{width} integers] rows, got {rows!r}")
    for row in rows:
        if (not isinstance(row, list) or len(row) != width
                or any(isinstance(v, bool) or not isinstance(v, int) or v < 1 for v in row)):
            raise ProfileConfigError(f"{name} rows must be lists of {width} positive integers, got {row!r}")


def validate(config: ProfileConfig) -> None:
    if not isinstance(config.name, str) or not config.name:
        raise ProfileConfigError(f"name must be a non-empty string, got {config.name!r}")
    _choice("device", config.device, DEVICES)
    _positive_int("seed", config.seed, minimum=0)
    if config.threads is not None:
        _positive_int("threads", config.threads)
    _validate_model(config.model)
    if not isinstance(config.bem, dict):
        raise ProfileConfigError(f"bem must be a mapping of HierarchicalBEMConfig fields, got {config.bem!r}")
    if not isinstance(config.mixers, list):
        raise ProfileConfigError(f"mixers must be a list of mixer kinds (hyena, mlstm), got {config.mixers!r}")
    for kind in config.mixers:
        _choice("mixers[]", kind, MIXERS)
    try:
        config.bem_config()
    except ValueError as err:
        raise ProfileConfigError(f"bem: {err}") from None
    if not isinstance(config.lora, bool):
        raise ProfileConfigError(f"lora must be true or false, got {config.lora!r}")
    _int_rows("prefill.shapes", config.prefill.shapes, 2)
    if not isinstance(config.decode.batch_sizes, list):
        raise ProfileConfigError(f"decode.batch_sizes must be a list, got {config.decode.batch_sizes!r}")
    for batch in config.decode.batch_sizes:
        _positive_int("decode.batch_sizes[]", batch)
    _positive_int("decode.prompt_length", config.decode.prompt_length)
    _positive_int("decode.new_tokens", config.decode.new_tokens, minimum=2)
    if not isinstance(config.decode.compiled, bool):
        raise ProfileConfigError(f"decode.compiled must be true or false, got {config.decode.compiled!r}")
    _choice("decode.compile_backend", config.decode.compile_backend, COMPILE_BACKENDS)
    if not isinstance(config.decode.eager, bool):
        raise ProfileConfigError(f"decode.eager must be true or false, got {config.decode.eager!r}")
    if not isinstance(config.train.enabled, bool):
        raise ProfileConfigError(f"train.enabled must be true or false, got {config.train.enabled!r}")
    _positive_int("train.batch_size", config.train.batch_size)
    _positive_int("train.sequence_length", config.train.sequence_length, minimum=2)
    _number("train.learning_rate", config.train.learning_rate, 0.0)
    _validate_timing(config.timing)
    _int_rows("kernels.shapes", config.kernels.shapes, 4, allow_empty=False)
    _choice("kernels.dtype", config.kernels.dtype, DTYPES)
    if not isinstance(config.kernels.run_with_profile, bool):
        raise ProfileConfigError(f"kernels.run_with_profile must be true or false, got {config.kernels.run_with_profile!r}")
    _number("max_overhead", config.max_overhead, 0.0)
    if not isinstance(config.gate, list):
        raise ProfileConfigError(f"gate must be a list of {', '.join(KINDS)}, got {config.gate!r}")
    for kind in config.gate:
        _choice("gate[]", kind, KINDS)
    if not isinstance(config.output_dir, str) or not config.output_dir:
        raise ProfileConfigError(f"output_dir must be a non-empty string, got {config.output_dir!r}")
    if not (config.prefill.shapes or config.decode.batch_sizes or config.train.enabled):
        raise ProfileConfigError("nothing to measure: prefill.shapes and decode.batch_sizes are empty and "
                                 "train.enabled is false")


def _validate_timing(timing: TimingSpec) -> None:
    _positive_int("timing.warmup", timing.warmup, minimum=0)
    _positive_int("timing.min_repeats", timing.min_repeats)
    _positive_int("timing.max_repeats", timing.max_repeats)
    if timing.max_repeats < timing.min_repeats:
        raise ProfileConfigError(f"timing.max_repeats must be >= timing.min_repeats ({timing.min_repeats}), "
                                 f"got {timing.max_repeats}")
    _number("timing.target_spread", timing.target_spread, 0.0)
    _number("timing.max_seconds", timing.max_seconds, 0.0)
    _number("timing.confidence", timing.confidence, 0.5, 0.999)
    needed = repeats_needed(timing.confidence)
    if timing.max_repeats < needed:
        raise ProfileConfigError(
            f"timing.max_repeats must be at least {needed} for a {100 * timing.confidence:g}% interval "
            f"(fewer repeats cannot bound it, so no setting could be decided), got {timing.max_repeats}")
    _number("timing.gpu_warmup_seconds", timing.gpu_warmup_seconds, 0.0, 60.0)


def _validate_model(model: ModelSpec) -> None:
    if (model.path is None) == (model.config is None):
        raise ProfileConfigError("model needs exactly one of model.path (a local directory) and model.config "
                                 "(a Hugging Face config mapping with model_type)")
    if model.path is not None and (not isinstance(model.path, str) or not model.path):
        raise ProfileConfigError(f"model.path must be a directory path, got {model.path!r}")
    if model.config is not None:
        if not isinstance(model.config, dict) or not isinstance(model.config.get("model_type"), str):
            raise ProfileConfigError(f"model.config must be a mapping with a model_type, got {model.config!r}")
    _choice("model.dtype", model.dtype, DTYPES)
    _choice("model.attn_implementation", model.attn_implementation, ATTENTION)
    try:
        model.quantization = check_quantization(model.quantization)
    except QuantizationConfigError as err:
        raise ProfileConfigError(str(err)) from None
