"""A quantized frozen base (QLoRA-style): the `quantization` key of a model section, in `bem train`'s and
`profile.py`'s YAML, and loading a model with it through bitsandbytes.

    model:
      quantization:
        bits: 4                   # 4 (Linear4bit) or 8 (Linear8bitLt)
        quant_type: nf4           # 4-bit only: nf4 or fp4
        compute_dtype: bfloat16   # 4-bit only: the dtype the layers compute in (float32, float16, bfloat16)
        double_quant: true        # 4-bit only: quantize the quantization constants too
        quant_storage: uint8      # 4-bit only: the dtype the packed weight is stored as (uint8, or bfloat16,
                                  # float16, float32 for FSDP, which shards floating-point parameters only)

BEM wraps the quantized layers and adds its update in the compute dtype (on a GPU, 4-bit layers take BEM's own
4-bit path, bem/kernels/quant/); adapters saved from such a model load onto a freshly quantized base, and merging
into a quantized weight is refused.
"""

from __future__ import annotations

import importlib.util
import tempfile
from typing import Any, Optional

import torch
import torch.nn as nn

COMPUTE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
STORAGE_DTYPES = {"uint8": torch.uint8, **COMPUTE_DTYPES}
FOUR_BIT_DEFAULTS = {"quant_type": "nf4", "compute_dtype": "bfloat16", "double_quant": False, "quant_storage": "uint8"}
KEYS = ("bits",) + tuple(FOUR_BIT_DEFAULTS)


class QuantizationConfigError(ValueError):
    """A bad `quantization` section: `field` (e.g. model.quantization.bits) and what is wrong with it."""

    def __init__(self, field: str, reason: str) -> None:
        super().__init__(f"{field}: {reason}")
        self.field, self.reason = field, reason


def check_quantization(values: Any, field: str = "model.quantization") -> Optional[dict[str, Any]]:
    """The section with its defaults filled in, or None for no quantization; QuantizationConfigError naming
    `field.key` on anything else."""
    if values is None:
        return None
    if not isinstance(values, dict):
        raise QuantizationConfigError(field, f"must be a mapping ({', '.join(KEYS)}), got {type(values).__name__}")
    unknown = sorted(set(values) - set(KEYS))
    if unknown:
        raise QuantizationConfigError(f"{field}.{unknown[0]}", f"unknown key; the keys are {', '.join(KEYS)}")
    bits = values.get("bits")
    if bits not in (4, 8) or isinstance(bits, bool):
        raise QuantizationConfigError(f"{field}.bits", f"must be 4 or 8, got {bits!r}")
    if bits == 8:
        given = sorted(set(values) & set(FOUR_BIT_DEFAULTS))
        if given:
            raise QuantizationConfigError(f"{field}.{given[0]}", "applies to 4-bit bases only (bits is 8)")
        return {"bits": 8}
    checked = {"bits": 4, **FOUR_BIT_DEFAULTS, **{k: v for k, v in values.items() if k != "bits"}}
    if checked["quant_type"] not in ("nf4", "fp4"):
        raise QuantizationConfigError(f"{field}.quant_type", f"must be 'nf4' or 'fp4', got {checked['quant_type']!r}")
    if checked["compute_dtype"] not in COMPUTE_DTYPES:
        raise QuantizationConfigError(f"{field}.compute_dtype", f"must be one of {', '.join(COMPUTE_DTYPES)}, "
                                                                f"got {checked['compute_dtype']!r}")
    if not isinstance(checked["double_quant"], bool):
        raise QuantizationConfigError(f"{field}.double_quant",
                                      f"must be true or false, got {checked['double_quant']!r}")
    if checked["quant_storage"] not in STORAGE_DTYPES:
        raise QuantizationConfigError(f"{field}.quant_storage", f"must be one of {', '.join(STORAGE_DTYPES)}, "
                                                                f"got {checked['quant_storage']!r}")
    return checked


def bitsandbytes_config(values: dict[str, Any], field: str = "model.quantization"):
    """transformers' `BitsAndBytesConfig` for a checked section; ImportError naming the package if it is missing."""
    if importlib.util.find_spec("bitsandbytes") is None:
        raise ImportError(f"{field} needs the bitsandbytes package (pip install 'bem[quantization]')")
    from transformers import BitsAndBytesConfig

    if values["bits"] == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    storage = values.get("quant_storage", FOUR_BIT_DEFAULTS["quant_storage"])  # a section checked before the key
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=values["quant_type"],
                              bnb_4bit_compute_dtype=COMPUTE_DTYPES[values["compute_dtype"]],
                              bnb_4bit_use_double_quant=values["double_quant"],
                              bnb_4bit_quant_storage=STORAGE_DTYPES[storage])


def load_quantized(path: str, values: dict[str, Any], device: torch.device, dtype: torch.dtype,
                   **kwargs: Any) -> nn.Module:
    """The causal LM at `path`, quantized by bitsandbytes as it loads onto `device` (weights that stay unquantized,
    such as the embeddings and norms, in `dtype`)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(path, quantization_config=bitsandbytes_config(values),
                                                device_map={"": str(device)}, dtype=dtype, **kwargs)


def quantized_copy(model: nn.Module, values: dict[str, Any], device: torch.device, **kwargs: Any) -> nn.Module:
    """`model` (a full-precision causal LM, e.g. one built with random weights) quantized: written to a temporary
    directory and loaded back through bitsandbytes, as a pretrained model would be."""
    dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
    with tempfile.TemporaryDirectory(prefix="bem_quantize_") as directory:
        model.save_pretrained(directory)
        return load_quantized(directory, values, device, dtype, **kwargs)
