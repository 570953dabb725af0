"""`HierarchicalBEMConfig`: every knob of a BEM adapter, validated on construction."""

from __future__ import annotations

import dataclasses
import difflib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Optional, Union

import yaml


MIXERS = ("hyena", "mlstm")


def closest_name(name: str, candidates) -> str:
    """' (did you mean 'x'?)' for a likely typo, else ''."""
    match = difflib.get_close_matches(name, list(candidates), n=1, cutoff=0.6)
    return f" (did you mean '{match[0]}'?)" if match else ""


@dataclass
class HierarchicalBEMConfig:
    """Configuration of a BEM adapter and its hierarchical routing controller.

    See DESIGN §1-3: the update is `s * ((x V) ⊙ c_t) U^T` with `s = alpha / rank`, and the code
    `c_t` comes from prefix, chunk and token routing levels, a norm clamp and an uncertainty gate.
    """

    # the low-rank update
    rank: int = 8
    alpha: float = 16.0
    dropout: float = 0.0
    # routing; enable_routing=False makes every code a constant one: BEM is then plain LoRA
    enable_routing: bool = True
    chunk_size: int = 32
    max_prefix_tokens: int = 128
    ema_decay: float = 0.9
    enable_uncertainty: bool = True
    enable_token_routing: bool = True
    code_clamp_value: float = 3.0
    side_signal_dim: Optional[int] = None
    controller_dim: int = 64
    # where to attach
    attach_mlp: bool = True
    attach_attention: bool = True
    attach_qkv: bool = False
    target_modules: Optional[Union[list[str], str]] = None
    token_routing_modules: Optional[Union[list[str], str]] = None
    # other modules trained (as a copy) and saved with the adapter, as PEFT's: a classification head
    modules_to_save: Optional[list[str]] = None
    # sequence mixers bolted on after decoder blocks (DESIGN §7): null, "hyena" or "mlstm"
    mixer: Optional[str] = None
    mixer_layers: Union[str, list[int]] = "all"  # block indices (negative from the end) or "all"
    mixer_dim: int = 128  # the mixer's inner width
    mixer_heads: int = 4  # mLSTM heads (mixer_dim / mixer_heads channels each)
    mixer_max_length: int = 2048  # Hyena: the filter's length, the longest sequence it takes
    mixer_conv_size: int = 3  # the causal short convolution in front of both mixers
    mixer_forget_bias: float = 3.0  # mLSTM forget gates' bias at init (one per head, from this to +3)
    mixer_input_bias: float = 0.0  # mLSTM input gates' bias at init
    # execution
    use_fused_kernels: bool = True
    # provenance, filled in when saving
    base_model_name_or_path: Optional[str] = None

    def __post_init__(self) -> None:
        self._validate()

    # ------------------------------------------------------------------ validation
    def _validate(self) -> None:
        int_fields = ("rank", "chunk_size", "max_prefix_tokens", "controller_dim")
        for name in int_fields:
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.rank > 1024:
            raise ValueError(f"rank must be at most 1024, got {self.rank}")
        for name in ("alpha", "dropout", "ema_decay", "code_clamp_value"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")
        if self.alpha <= 0:
            raise ValueError(f"alpha must be > 0, got {self.alpha!r}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"dropout must be in [0, 1), got {self.dropout!r}")
        if not 0.0 <= self.ema_decay < 1.0:
            raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay!r}")
        if self.code_clamp_value <= 0:
            raise ValueError(f"code_clamp_value must be > 0, got {self.code_clamp_value!r}")
        for name in ("enable_routing", "enable_uncertainty", "enable_token_routing", "attach_mlp",
                     "attach_attention", "attach_qkv", "use_fused_kernels"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be true or false, got {getattr(self, name)!r}")
        if self.side_signal_dim is not None and (
            isinstance(self.side_signal_dim, bool) or not isinstance(self.side_signal_dim, int)
            or self.side_signal_dim < 1
        ):
            raise ValueError(f"side_signal_dim must be a positive integer or null, got {self.side_signal_dim!r}")
        for name in ("target_modules", "token_routing_modules"):
            self._validate_module_selector(name, getattr(self, name))
        saved = self.modules_to_save
        if saved is not None and not (
            isinstance(saved, (list, tuple)) and saved and all(isinstance(v, str) and v for v in saved)
        ):
            raise ValueError(f"modules_to_save must be a non-empty list of module names, got {saved!r}")
        if self.target_modules is None and not (self.attach_mlp or self.attach_attention or self.attach_qkv):
            raise ValueError(
                "attach_mlp, attach_attention and attach_qkv are all false and target_modules is empty: "
                "nothing would be wrapped"
            )
        self._validate_mixer()
        if self.base_model_name_or_path is not None and not isinstance(self.base_model_name_or_path, str):
            raise ValueError(f"base_model_name_or_path must be a string, got {self.base_model_name_or_path!r}")

    def _validate_mixer(self) -> None:
        if self.mixer is not None and self.mixer not in MIXERS:
            raise ValueError(f"mixer must be null, 'hyena' or 'mlstm', got {self.mixer!r}"
                             f"{closest_name(str(self.mixer), MIXERS)}")
        layers = self.mixer_layers
        if layers != "all" and not (
            isinstance(layers, (list, tuple)) and layers
            and all(isinstance(i, int) and not isinstance(i, bool) for i in layers)
        ):
            raise ValueError(f"mixer_layers must be 'all' or a non-empty list of block indices, got {layers!r}")
        if isinstance(layers, (list, tuple)) and len(set(layers)) != len(layers):
            raise ValueError(f"mixer_layers names a block twice: {list(layers)!r}")
        for name, low, high in (("mixer_dim", 1, 65536), ("mixer_heads", 1, 4096), ("mixer_max_length", 1, 1 << 20),
                                ("mixer_conv_size", 1, 64)):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
                raise ValueError(f"{name} must be an integer in [{low}, {high}], got {value!r}")
        if self.mixer_dim % self.mixer_heads:
            raise ValueError(f"mixer_dim ({self.mixer_dim}) must be a multiple of mixer_heads ({self.mixer_heads})")
        for name in ("mixer_forget_bias", "mixer_input_bias"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
                raise ValueError(f"{name} must be a finite number, got {value!r}")

    @staticmethod
    def _validate_module_selector(name: str, value: Any) -> None:
        if value is None:
            return
        if isinstance(value, str):
            if not value:
                raise ValueError(f"{name} must not be an empty string")
            try:
                re.compile(value)
            except re.error as err:
                raise ValueError(f"{name} is not a valid regular expression ({err}): {value!r}") from None
            return
        if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) and v for v in value):
            return
        raise ValueError(f"{name} must be a regex string or a non-empty list of module names, got {value!r}")

    # ------------------------------------------------------------------ (de)serialisation
    @property
    def scaling(self) -> float:
        return self.alpha / self.rank

    def to_dict(self) -> dict[str, Any]:
        data = dataclasses.asdict(self)
        for name in ("target_modules", "token_routing_modules", "modules_to_save", "mixer_layers"):
            if isinstance(data[name], tuple):
                data[name] = list(data[name])
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "HierarchicalBEMConfig":
        if not isinstance(data, dict):
            raise ValueError(f"a BEM config must be a mapping of field names to values, got {type(data).__name__}")
        known = {f.name for f in dataclasses.fields(cls)}
        for key in data:
            if key not in known:
                raise ValueError(f"unknown BEM config field '{key}'{closest_name(str(key), known)}")
        return cls(**data)

    def to_yaml(self, path: Optional[Union[str, Path]] = None) -> str:
        text = yaml.safe_dump(self.to_dict(), sort_keys=False)
        if path is not None:
            from .io_utils import atomic_write_text

            atomic_write_text(Path(path), text)
        return text

    @classmethod
    def from_yaml(cls, source: Union[str, Path]) -> "HierarchicalBEMConfig":
        """Read a YAML file (a path) or YAML text; a top-level `bem:` section is accepted too."""
        text = Path(source).read_text() if _looks_like_path(source) else str(source)
        data = yaml.safe_load(text) or {}
        if isinstance(data, dict) and set(data) == {"bem"}:
            data = data["bem"] or {}
        return cls.from_dict(data)

    def to_json(self) -> str:
        return json.dumps(self.to_dict(), indent=2, sort_keys=True)


def _looks_like_path(source: Union[str, Path]) -> bool:
    if isinstance(source, Path):
        return True
    return "\n" not in source and ":" not in source and Path(source).suffix in {".yaml", ".yml"}
