"""Where a training step's memory goes: BEM against PEFT LoRA on one profile config, one setup.

    PYTHONPATH=. python scripts/train_memory_probe.py --config configs/profile_phi3_mini.yaml --setup bf16 \
        [--batch-size 4] [--seq-len 1024] [--device cpu]

Per variant, after one warm-up step (the optimizer's state exists): the tensors the forward saves for the
backward, grouped by dtype and last dimension (unique storages, parameters left out), then on a GPU the
allocation after the forward and the peaks of the forward, the backward and the optimizer step, each above what
was allocated before the step. The training benchmark reports only the whole step's peak; this says which phase
and which saved tensors make the difference. With --allocations (GPU only), the blocks the forward allocated that
are still live after it, grouped by the innermost line of bem, peft or transformers that allocated them: what
holds memory until the backward without being a saved tensor (a checkpoint's inputs, module attributes).
"""

from __future__ import annotations

import argparse
import sys
import warnings
from collections import defaultdict
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent.parent
for folder in (ROOT, ROOT / "benchmarks"):
    sys.path.insert(0, str(folder))

from train_setups import SETUPS, set_trainable_dtype, training_step  # noqa: E402

from bem.profiling.config import load_profile_config  # noqa: E402
from bem.profiling.models import build_variants, load_base_model, vocab_size  # noqa: E402
from bem.profiling.workloads import saved_storages  # noqa: E402

MIB = 2 ** 20


def saved_tensors(model: torch.nn.Module, forward) -> dict[tuple, list[int]]:
    """(dtype, last dim) -> [bytes, storages] of what `forward` saves for the backward; returns its loss too."""
    with saved_storages(model) as storages:
        loss = forward()
    groups: dict[tuple, list[int]] = defaultdict(lambda: [0, 0])
    for dtype, last, nbytes in storages.values():
        key = (str(dtype).replace("torch.", ""), last)
        groups[key][0] += nbytes
        groups[key][1] += 1
    return loss, dict(groups)


SITES = ("/bem/", "/peft/", "/transformers/", "/torch/utils/checkpoint")


def live_allocations(snapshot: dict) -> dict[str, list[int]]:
    """site -> [bytes, blocks] of the live blocks with a recorded stack (allocated while history was on)."""
    sites: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    for segment in snapshot["segments"]:
        for block in segment["blocks"]:
            frames = block.get("frames") or []
            if block["state"] != "active_allocated" or not frames:
                continue
            site = next((f"{f['filename'].split('site-packages/')[-1]}:{f['line']} {f['name']}" for f in frames
                         if any(mark in f["filename"] for mark in SITES)), "elsewhere")
            sites[site][0] += block["size"]
            sites[site][1] += 1
    return dict(sites)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--config", required=True)
    parser.add_argument("--setup", choices=sorted(SETUPS), default="bf16")
    parser.add_argument("--batch-size", type=int)
    parser.add_argument("--seq-len", type=int)
    parser.add_argument("--device")
    parser.add_argument("--allocations", action="store_true",
                        help="list the forward's live allocations by the line that made them (GPU)")
    args = parser.parse_args()
    config = load_profile_config(args.config)
    device = torch.device(args.device or config.device)
    setup = SETUPS[args.setup]
    batch = args.batch_size or config.train.batch_size
    length = args.seq_len or config.train.sequence_length
    base = load_base_model(config.model, device, config.seed)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        variants = build_variants(base, config.bem_config(), with_lora=True)
    generator = torch.Generator().manual_seed(config.seed)
    ids = torch.randint(3, vocab_size(base), (batch, length), generator=generator).to(device)
    cuda = device.type == "cuda"
    print(f"{config.name}, {setup.describe()}, batch {batch} x {length}")
    for name, model in (("bem", variants.bem), ("lora", variants.lora)):
        set_trainable_dtype(model, setup.adapter_dtype)
        model.train()
        step, optimizer = training_step(model, [ids], setup, config.train.learning_rate, device)
        step(0)  # the optimizer's state, the kernels' first calls
        if cuda:
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
        before = torch.cuda.memory_allocated(device) if cuda else 0

        def forward():
            with torch.autocast(device.type, dtype=torch.bfloat16, enabled=setup.autocast):
                return model(input_ids=ids, attention_mask=torch.ones_like(ids), labels=ids, use_cache=False).loss

        record = cuda and args.allocations
        if record:
            torch.cuda.memory._record_memory_history(max_entries=200_000, stacks="python")
        loss, groups = saved_tensors(model, forward)
        sites = None
        if record:
            sites = live_allocations(torch.cuda.memory._snapshot())
            torch.cuda.memory._record_memory_history(enabled=None)
        phases = {}
        if cuda:
            torch.cuda.synchronize(device)
            phases["after forward"] = torch.cuda.memory_allocated(device) - before
            phases["forward peak"] = torch.cuda.max_memory_allocated(device) - before
            torch.cuda.reset_peak_memory_stats(device)
        loss.backward()
        if cuda:
            torch.cuda.synchronize(device)
            phases["backward peak"] = torch.cuda.max_memory_allocated(device) - before
            torch.cuda.reset_peak_memory_stats(device)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if cuda:
            torch.cuda.synchronize(device)
            phases["optimizer peak"] = torch.cuda.max_memory_allocated(device) - before
        total = sum(nbytes for nbytes, _ in groups.values())
        print(f"\n{name}: saved for the backward {total / MIB:.2f} MiB in "
              f"{sum(count for _, count in groups.values())} storages")
        for (dtype, last), (nbytes, count) in sorted(groups.items(), key=lambda item: -item[1][0]):
            print(f"  {dtype:<9} last dim {last:>6}: {nbytes / MIB:10.2f} MiB in {count:4d} storages")
        for phase, nbytes in phases.items():
            print(f"  {phase:<15} {nbytes / MIB:10.2f} MiB above the step's start")
        if sites is not None:
            print(f"  live after the forward, by the line that allocated ({sum(b for b, _ in sites.values()) / MIB:.2f} MiB):")
            for site, (nbytes, count) in sorted(sites.items(), key=lambda item: -item[1][0])[:25]:
                print(f"    {nbytes / MIB:10.2f} MiB in {count:4d} blocks  {site}")
        del loss, step, optimizer


if __name__ == "__main__":
    main()
