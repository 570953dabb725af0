"""`TrainConfig`: a training YAML file plus command-line overrides, fully checked before any model loads."""

from __future__ import annotations

import dataclasses
import importlib.util
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional, Sequence, Union

import yaml

from ..config import HierarchicalBEMConfig, closest_name
from .schema import (SECTION_NAMES, suggest, SECTIONS, ConfigError, DataSection, LoggingSection, ModelSection,
                     TrainingSection, build_section, section_fields)


@dataclass
class TrainConfig:
    model: ModelSection
    bem: HierarchicalBEMConfig
    data: DataSection
    training: TrainingSection
    logging: LoggingSection
    source: Optional[str] = None  # the YAML file it came from, for messages

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": dataclasses.asdict(self.model),
            "bem": self.bem.to_dict(),
            "data": dataclasses.asdict(self.data),
            "training": dataclasses.asdict(self.training),
            "logging": dataclasses.asdict(self.logging),
        }

    def to_yaml(self) -> str:
        return yaml.safe_dump(self.to_dict(), sort_keys=False)

    @property
    def output_dir(self) -> Path:
        return Path(self.training.output_dir)


def load_train_config(path: Union[str, Path], overrides: Sequence[str] = (), check_paths: bool = True) -> TrainConfig:
    """Read `path`, apply `key.sub=value` overrides, check every section and (optionally) every path."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError("", f"config file not found: {path}")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as err:
        raise ConfigError("", f"{path} is not valid YAML: {err}") from None
    config = config_from_dict(apply_overrides(raw, overrides))
    config.source = str(path)
    if check_paths:
        check_environment(config)
    return config


def config_from_dict(raw: Any) -> TrainConfig:
    """Check a raw mapping (already overridden); relative paths stay relative to the working directory."""
    if not isinstance(raw, dict):
        raise ConfigError("", f"a training config must be a mapping with sections {', '.join(SECTION_NAMES)}")
    for key in raw:
        if key not in SECTION_NAMES:
            raise ConfigError(str(key), f"unknown section{closest_name(str(key), SECTION_NAMES)}; "
                                        f"valid sections: {', '.join(SECTION_NAMES)}")
    sections = {name: build_section(cls, raw.get(name), name) for name, cls in SECTIONS.items()}
    return TrainConfig(bem=_build_bem(raw.get("bem")), **sections)


def _build_bem(raw: Any) -> HierarchicalBEMConfig:
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise ConfigError("bem", f"must be a mapping of HierarchicalBEMConfig fields, got {raw!r}")
    known = [f.name for f in dataclasses.fields(HierarchicalBEMConfig)]
    for key in raw:
        if key not in known:
            raise ConfigError(f"bem.{key}", f"unknown key{suggest(str(key), known)}")
    try:
        return HierarchicalBEMConfig.from_dict(dict(raw))
    except (ValueError, TypeError) as err:
        # HierarchicalBEMConfig's messages start with the field name
        field_name = str(err).split(" ", 1)[0]
        key = f"bem.{field_name}" if field_name in known else "bem"
        raise ConfigError(key, str(err)) from None


def apply_overrides(raw: dict, overrides: Sequence[str]) -> dict:
    """Return a copy of `raw` with each `section.key=value` set; the value is parsed as YAML."""
    result = {name: (dict(value) if isinstance(value, dict) else value) for name, value in (raw or {}).items()}
    for item in overrides:
        key, sep, text = item.partition("=")
        key = key.strip()
        if not sep or not key:
            raise ConfigError(item, "an override must look like section.key=value (e.g. training.lr=3e-4)")
        parts = key.split(".")
        _check_override_key(parts, key)
        try:
            value = yaml.safe_load(text) if text.strip() else None
        except yaml.YAMLError as err:
            raise ConfigError(key, f"could not parse override value {text!r}: {err}") from None
        node = result
        for part in parts[:-1]:
            child = node.get(part)
            if child is None:
                child = {}
            elif not isinstance(child, dict):
                raise ConfigError(key, f"'{part}' is not a section that holds keys")
            node[part] = child = dict(child)
            node = child
        node[parts[-1]] = value
    return result


def _check_override_key(parts: list[str], key: str) -> None:
    if parts[0] not in SECTION_NAMES:
        raise ConfigError(key, f"unknown section '{parts[0]}'{closest_name(parts[0], SECTION_NAMES)}")
    if len(parts) < 2:
        raise ConfigError(key, "an override names a key inside a section, e.g. training.lr=3e-4")
    if parts[0] == "bem":
        known = [f.name for f in dataclasses.fields(HierarchicalBEMConfig)]
    else:
        known = list(section_fields(SECTIONS[parts[0]]))
    if parts[1] not in known:
        raise ConfigError(key, f"unknown key{suggest(parts[1], known)}")
    # only model.config_overrides is a free-form mapping that takes deeper keys
    if len(parts) > 2 and (parts[0], parts[1]) != ("model", "config_overrides"):
        raise ConfigError(key, f"'{parts[0]}.{parts[1]}' takes a value, not sub-keys")


def check_environment(config: TrainConfig) -> None:
    """Paths exist and optional packages are there: the last checks before anything heavy runs."""
    model = config.model
    if model.path is not None:
        if not (Path(model.path) / "config.json").is_file():
            raise ConfigError("model.path", f"no pretrained model at {model.path} (expected a directory with config.json)")
    if model.architecture is not None:
        from .presets import preset_config

        preset_config(model.architecture, model.size, model.config_overrides)
    if model.tokenizer is not None and not Path(model.tokenizer).exists():
        raise ConfigError("model.tokenizer", f"not found: {model.tokenizer}")
    for key in ("train", "eval"):
        value = getattr(config.data, key)
        for index, item in enumerate([value] if isinstance(value, str) else (value or [])):
            name = f"data.{key}" if isinstance(value, str) else f"data.{key}[{index}]"
            _check_data_path(name, Path(item))
    if config.logging.tensorboard and importlib.util.find_spec("tensorboard") is None:
        raise ConfigError("logging.tensorboard", "is true but the tensorboard package is not installed "
                                                 "(pip install tensorboard, or set it to false)")
    if config.training.distributed == "fsdp":
        _check_fsdp_support()
    resume = config.training.resume
    if resume not in (None, "latest") and not Path(resume).is_dir():
        raise ConfigError("training.resume", f"checkpoint directory not found: {resume} (or use 'latest')")


# FSDP2 leaving some parameters unsharded (`ignored_params`): BEM keeps the controller whole
FSDP_MIN_TORCH = (2, 7)


def _check_fsdp_support() -> None:
    import torch

    release = tuple(int(part) for part in torch.__version__.split("+")[0].split(".")[:2])
    if release < FSDP_MIN_TORCH:
        raise ConfigError("training.distributed", f"fsdp needs torch >= {'.'.join(map(str, FSDP_MIN_TORCH))} "
                                                  f"(FSDP2 with the routing controller left unsharded); this is "
                                                  f"torch {torch.__version__}: upgrade torch, or use ddp")


def _check_data_path(key: str, path: Path) -> None:
    if path.is_dir():
        if importlib.util.find_spec("datasets") is None:
            raise ConfigError(key, f"{path} is a directory, which is read as a saved `datasets` dataset, but the "
                                   f"datasets package is not installed (pip install datasets, or give jsonl/txt files)")
        return
    if not path.is_file():
        raise ConfigError(key, f"data file not found: {path}")
    if path.suffix not in {".jsonl", ".json", ".txt"}:
        raise ConfigError(key, f"unsupported data file type '{path.suffix}' for {path} (use .jsonl, .json or .txt)")
