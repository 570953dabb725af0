"""What a BEM training step keeps for its backward that PEFT LoRA's does not, by tensor shape and dtype.

    PYTHONPATH=. python scripts/saved_tensors_diff.py --config configs/profile_qwen2_0.5b_nf4.yaml [--batch 4]
        [--seq-len 1024] [--device cuda]

The config's base (random weights, as the profiler builds it), wrapped with BEM and with LoRA at the same rank and
targets, bf16 adapters; one forward with labels under `saved_tensors_hooks`, each saved storage counted once
(frozen weights saved by reference are listed too: they cost nothing extra). Prints each variant's total, the rows
whose bytes differ most, and on a GPU each step's peak allocation above what the model holds.
"""

from __future__ import annotations

import argparse
import collections
from dataclasses import replace

import torch

from bem.profiling.config import load_profile_config
from bem.profiling.models import build_variants, load_base_model, resolve_device, vocab_size


def saved_inventory(model: torch.nn.Module, ids: torch.Tensor) -> tuple[int, collections.Counter, int]:
    """(bytes saved for the backward, bytes by (shape, dtype), the step's peak allocation above its start)."""
    by_kind: collections.Counter = collections.Counter()
    seen: set = set()

    def pack(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        key = (storage.data_ptr(), tensor.device)
        if key not in seen:
            seen.add(key)
            by_kind[(tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))] += storage.nbytes()
        return tensor

    cuda = ids.is_cuda
    if cuda:
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        start = torch.cuda.memory_allocated()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda tensor: tensor):
        loss = model(input_ids=ids, labels=ids).loss
    loss.backward()
    peak = torch.cuda.max_memory_allocated() - start if cuda else 0
    model.zero_grad(set_to_none=True)
    return sum(by_kind.values()), by_kind, peak


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--config", required=True)
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--device")
    parser.add_argument("--rows", type=int, default=20)
    args = parser.parse_args()
    config = load_profile_config(args.config)
    device = resolve_device(args.device or config.device)
    base = load_base_model(replace(config.model, dtype="bfloat16"), device, config.seed)
    variants = build_variants(base, config.bem_config(), with_lora=True)
    batch, length = args.batch or config.train.batch_size, args.seq_len or config.train.sequence_length
    ids = torch.randint(3, vocab_size(base), (batch, length), generator=torch.Generator().manual_seed(0)).to(device)
    found = {}
    for name, model in (("bem", variants.bem), ("lora", variants.lora)):
        for param in model.parameters():
            if param.requires_grad:
                param.data = param.data.to(torch.bfloat16)
        model.train()
        saved_inventory(model, ids)  # a first step: what a process's first calls allocate for good
        found[name] = saved_inventory(model, ids)
        total, _, peak = found[name]
        print(f"{name}: saved {total / 2**20:.1f} MiB" + (f", step peak {peak / 2**20:.1f} MiB" if peak else ""))
    bem, lora = found["bem"][1], found["lora"][1]
    rows = sorted(set(bem) | set(lora), key=lambda kind: -abs(bem.get(kind, 0) - lora.get(kind, 0)))
    print(f"{'MiB, bem - lora':>16}  {'bem':>9}  {'lora':>9}  shape, dtype")
    for kind in rows[:args.rows]:
        difference = bem.get(kind, 0) - lora.get(kind, 0)
        if difference:
            print(f"{difference / 2**20:+16.2f}  {bem.get(kind, 0) / 2**20:9.2f}  {lora.get(kind, 0) / 2**20:9.2f}  "
                  f"{kind[0]}, {kind[1]}")


if __name__ == "__main__":
    main()
