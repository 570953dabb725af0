"""The quality benchmark's frozen base: a byte-level Llama, either with random weights (the CPU tests) or
pretrained here on real text that every machine with this package has, the Python sources of the installed
packages (torch's and transformers'), and cached with `save_pretrained` so later runs load it."""

from __future__ import annotations

import hashlib
import json
import math
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Callable, Optional

import torch
import torch.nn as nn

VOCAB = 256  # bytes


@dataclass(frozen=True)
class BaseSpec:
    width: int = 256
    layers: int = 4
    heads: int = 4
    pretrain_steps: int = 600  # 0: random weights
    context: int = 128
    batch: int = 32
    seed: int = 0
    window: int = 0  # the attention's sliding window in tokens (a Mistral); 0: full attention (a Llama)

    def key(self) -> str:
        fields = asdict(self)
        if not self.window:  # the full-attention bases keep the keys they were cached under
            del fields["window"]
        return hashlib.sha256(json.dumps(fields, sort_keys=True).encode()).hexdigest()[:12]


def fresh_model(spec: BaseSpec) -> nn.Module:
    """A Llama, or with `spec.window` a Mistral whose attention sees only the last `window` tokens (the same
    layers otherwise), so that a token further back reaches a position only through what an adapter or a mixer
    carries."""
    from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

    torch.manual_seed(spec.seed)
    shapes = dict(vocab_size=VOCAB, hidden_size=spec.width, intermediate_size=4 * spec.width,
                  num_hidden_layers=spec.layers, num_attention_heads=spec.heads, num_key_value_heads=spec.heads,
                  max_position_embeddings=512, pad_token_id=0, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=True)
    if spec.window:
        config, model_class = MistralConfig(sliding_window=spec.window, **shapes), MistralForCausalLM
    else:
        config, model_class = LlamaConfig(**shapes), LlamaForCausalLM
    config._attn_implementation = "sdpa"
    return model_class(config)


def source_text(limit_bytes: int = 8 << 20) -> torch.Tensor:
    """Up to `limit_bytes` of the installed torch and transformers packages' Python sources, as byte ids."""
    import transformers

    chunks, total = [], 0
    for package in (torch, transformers):
        for path in sorted(Path(package.__file__).parent.rglob("*.py")):
            data = path.read_bytes()
            chunks.append(data)
            total += len(data)
            if total >= limit_bytes:
                break
        if total >= limit_bytes:
            break
    return torch.frombuffer(bytearray(b"\n".join(chunks)[:limit_bytes]), dtype=torch.uint8).long()


def pretrain(model: nn.Module, spec: BaseSpec, device: torch.device, log: Callable[[str], None]) -> list[float]:
    """Next-byte prediction on `source_text` windows; returns the loss every 50 steps."""
    text = source_text()
    generator = torch.Generator().manual_seed(spec.seed)
    model.to(device).train()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.01)
    schedule = torch.optim.lr_scheduler.LambdaLR(
        optimizer, lambda step: min(1.0, (step + 1) / 50) * 0.5 * (1 + math.cos(math.pi * step / spec.pretrain_steps)))
    losses, started = [], time.perf_counter()
    for step in range(spec.pretrain_steps):
        starts = torch.randint(0, len(text) - spec.context - 1, (spec.batch,), generator=generator)
        ids = torch.stack([text[s:s + spec.context] for s in starts]).to(device)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optimizer.step()
        schedule.step()
        optimizer.zero_grad(set_to_none=True)
        if step % 50 == 0 or step == spec.pretrain_steps - 1:
            losses.append(loss.item())
            log(f"  pretraining the base: step {step}, loss {loss.item():.3f} ({time.perf_counter() - started:.0f} s)")
    return losses


def frozen_base(spec: BaseSpec, device: torch.device, cache_dir: Optional[Path],
                log: Callable[[str], None] = print) -> nn.Module:
    """The base of `spec` in eval mode on `device`: loaded from `cache_dir` when it was pretrained there before."""
    from transformers import AutoModelForCausalLM

    path = None if cache_dir is None else Path(cache_dir) / f"base-{spec.key()}"
    if path is not None and (path / "config.json").is_file():
        return AutoModelForCausalLM.from_pretrained(path, attn_implementation="sdpa").to(device).eval()
    model = fresh_model(spec)
    if spec.pretrain_steps:
        pretrain(model, spec, device, log)
        if path is not None:  # written aside, then renamed: a cut-off run leaves no half-written cache
            staging = path.with_name(path.name + ".tmp")
            model.save_pretrained(staging)
            (staging / "base_spec.json").write_text(json.dumps(asdict(spec)))
            staging.replace(path)
    return model.to(device).eval()
