"""Does a mixer add something real? A synthetic long-range recall task on a base that cannot see far.

Each sequence is `KEY k  f_1 ... f_N  QUERY -> k`: a key k (one of `--keys` values) followed by N random filler
tokens (N >= 64 by default), then a query whose answer is the key. The frozen base is a tiny Mistral whose
attention sees only the last `--window` tokens (sliding window), so the key is out of its reach. BEM is
trained on the answer alone, three ways, same seed and steps: expert modules only, and with a Hyena or an mLSTM
mixer after every block. Accuracy is measured on fresh sequences. BEM's routing is itself a long-range channel
(its prefix summary spans the key); `--no-routing` leaves the expert modules plain low-rank updates.

    PYTHONPATH=. python scripts/long_range_recall.py [--steps 300] [--filler 64] [--no-routing] [--json FILE]
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass

import torch
from transformers import MistralConfig, MistralForCausalLM

from bem import HierarchicalBEMConfig, create_hierarchical_bem

PAD, KEY, QUERY = 0, 1, 2
FIRST_KEY = 3


@dataclass
class Task:
    keys: int = 4
    filler: int = 64
    filler_vocab: int = 16

    @property
    def vocab(self) -> int:
        return FIRST_KEY + self.keys + self.filler_vocab

    def batch(self, size: int, generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        """(ids (size, filler + 4), the key of each row)."""
        keys = torch.randint(0, self.keys, (size,), generator=generator) + FIRST_KEY
        filler = torch.randint(0, self.filler_vocab, (size, self.filler), generator=generator) + FIRST_KEY + self.keys
        ids = torch.cat([torch.full((size, 1), KEY), keys[:, None], filler, torch.full((size, 1), QUERY),
                         keys[:, None]], dim=1)
        return ids, keys


def base_model(task: Task, window: int, seed: int) -> MistralForCausalLM:
    torch.manual_seed(seed)
    config = MistralConfig(vocab_size=task.vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                           sliding_window=window, pad_token_id=PAD, bos_token_id=None, eos_token_id=None)
    config._attn_implementation = "eager"
    return MistralForCausalLM(config).eval()


def variant_config(mixer: str | None, filler: int, routing: bool) -> HierarchicalBEMConfig:
    return HierarchicalBEMConfig(rank=8, alpha=16.0, attach_qkv=True, use_fused_kernels=False, mixer=mixer,
                                 mixer_dim=32, mixer_heads=4, mixer_max_length=max(128, filler + 8),
                                 enable_routing=routing)


def accuracy(model, task: Task, generator: torch.Generator, batches: int = 4, size: int = 128) -> float:
    correct = total = 0
    with torch.no_grad():
        for _ in range(batches):
            ids, keys = task.batch(size, generator)
            answer = model(input_ids=ids[:, :-1]).logits[:, -1].argmax(-1)
            correct += int((answer == keys).sum())
            total += size
    return correct / total


def train_variant(name: str, mixer: str | None, task: Task, window: int, steps: int, seed: int, routing: bool,
                  batch_size: int = 32, lr: float = 3e-3) -> dict:
    model = create_hierarchical_bem(base_model(task, window, seed), variant_config(mixer, task.filler, routing))
    torch.manual_seed(seed + 1)
    optimizer = torch.optim.AdamW(model.adapter_parameters(), lr=lr)
    generator = torch.Generator().manual_seed(seed + 2)
    model.train()
    started = time.perf_counter()
    for _ in range(steps):
        ids, _ = task.batch(batch_size, generator)
        labels = torch.full_like(ids, -100)
        labels[:, -1] = ids[:, -1]  # the loss is on the answer alone
        loss = model(input_ids=ids, labels=labels).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    model.eval()
    seconds = time.perf_counter() - started
    result = {"variant": name, "routing": routing, "accuracy": accuracy(model, task, torch.Generator().manual_seed(seed + 3)),
              "final_loss": float(loss.detach()), "train_seconds": seconds}
    return result


VARIANTS = {"bem": None, "bem+hyena": "hyena", "bem+mlstm": "mlstm"}


def run(steps: int = 300, filler: int = 64, keys: int = 4, window: int = 8, seed: int = 0,
        variants: tuple[str, ...] = tuple(VARIANTS), routing: bool = True) -> list[dict]:
    task = Task(keys=keys, filler=filler)
    return [train_variant(name, VARIANTS[name], task, window, steps, seed, routing) for name in variants]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--filler", type=int, default=64, help="filler tokens between the key and the query")
    parser.add_argument("--keys", type=int, default=4, help="distinct keys (chance is 1 / keys)")
    parser.add_argument("--window", type=int, default=8, help="the base's sliding attention window")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--no-routing", action="store_true", help="BEM with routing off (plain LoRA modules)")
    parser.add_argument("--json", help="write the results to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(max(1, torch.get_num_threads()))
    results = run(args.steps, args.filler, args.keys, args.window, args.seed, routing=not args.no_routing)
    print(f"recall of a key {args.filler + 2} tokens back; base attention window {args.window}; "
          f"chance {1 / args.keys:.2f}; {args.steps} steps; routing {'off' if args.no_routing else 'on'}")
    print(f"{'variant':<12}{'accuracy':>10}{'final loss':>12}{'train s':>9}")
    for r in results:
        print(f"{r['variant']:<12}{r['accuracy']:>10.3f}{r['final_loss']:>12.3f}{r['train_seconds']:>9.1f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"arguments": vars(args), "results": results}, f, indent=1)


if __name__ == "__main__":
    main()
