"""scripts/train_memory_probe.py's saved-tensor inventory on the CPU: a BEM training step keeps for its backward
what LoRA's keeps, plus its codes (r wide)."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO / "scripts"))

import train_memory_probe  # noqa: E402

from bem.profiling.config import load_profile_config  # noqa: E402
from bem.profiling.models import build_variants, load_base_model, vocab_size  # noqa: E402


def test_bem_keeps_what_lora_keeps_and_its_codes():
    config = load_profile_config(REPO / "configs/profile_tiny.yaml")
    base = load_base_model(config.model, torch.device("cpu"), config.seed)
    variants = build_variants(base, config.bem_config(), with_lora=True)
    ids = torch.randint(3, vocab_size(base), (2, 24), generator=torch.Generator().manual_seed(0))
    groups = {}
    for name, model in (("bem", variants.bem), ("lora", variants.lora)):
        model.train()
        loss, groups[name] = train_memory_probe.saved_tensors(
            model, lambda model=model: model(input_ids=ids, labels=ids).loss)
        loss.backward()
    bem, lora = groups["bem"], groups["lora"]
    more = {kind: bem.get(kind, [0])[0] - lora.get(kind, [0])[0] for kind in set(bem) | set(lora)}
    assert any(more.values()), "no row differs: BEM keeps its codes beside what LoRA keeps"
    for (dtype, last), difference in more.items():  # each kind BEM keeps more of is r wide (the codes), none less
        assert difference >= 0 and (difference == 0 or last == config.bem_config().rank), (dtype, last, difference)
