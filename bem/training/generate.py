"""Load a saved adapter onto its base model and generate from prompts."""

from __future__ import annotations

from pathlib import Path
from typing import Optional, Sequence

import torch

from .model_factory import DTYPES


class GenerateError(ValueError):
    """A problem with what `bem generate` was asked to do (missing adapter, base, ...)."""


def resolve_base(adapter_dir: Path, base: Optional[str]) -> Path:
    from ..persistence import read_adapter_config

    try:
        record = read_adapter_config(adapter_dir)
    except (FileNotFoundError, ValueError) as err:
        raise GenerateError(str(err)) from None
    source = base or record["bem_config"].get("base_model_name_or_path")
    if not source:
        raise GenerateError(f"the adapter in {adapter_dir} does not record its base model; pass --base")
    path = Path(source)
    if not (path / "config.json").is_file():
        hint = "" if base else " (recorded in the adapter config; pass --base to use another)"
        raise GenerateError(f"base model not found at {path}{hint}")
    return path


def generate_texts(adapter: str, prompts: Sequence[str], base: Optional[str] = None, max_new_tokens: int = 32,
                   temperature: float = 0.0, top_p: float = 1.0, seed: int = 0, device: Optional[str] = None,
                   dtype: Optional[str] = None) -> list[str]:
    """The continuation of each prompt (prompt text not included)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from .. import BEMModel

    adapter_dir = Path(adapter)
    base_path = resolve_base(adapter_dir, base)
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    tokenizer = AutoTokenizer.from_pretrained(base_path)
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    tokenizer.padding_side = "left"  # BEM counts positions from the first real token, so left padding is exact
    kwargs = {"dtype": DTYPES[dtype]} if dtype else {}
    base_model = AutoModelForCausalLM.from_pretrained(base_path, **kwargs).to(device)
    model = BEMModel.from_pretrained(base_model, adapter_dir)
    model.eval()
    torch.manual_seed(seed)
    batch = tokenizer(list(prompts), return_tensors="pt", padding=True).to(device)
    sampling = {"do_sample": True, "temperature": temperature, "top_p": top_p} if temperature > 0 else {"do_sample": False}
    with torch.no_grad():
        output = model.generate(**batch, max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                                eos_token_id=tokenizer.eos_token_id, **sampling)
    new_tokens = output[:, batch["input_ids"].shape[1]:]
    return tokenizer.batch_decode(new_tokens, skip_special_tokens=True)
