"""Probe of compiled decoding on a GPU: per-call times of generate with a static cache (generate compiles the
decoding step), base against BEM, at two batch sizes, with dynamo's counters; run with TORCH_LOGS set to see
recompiles and CUDA-graph decisions."""

from __future__ import annotations

import sys
import time

import torch
from torch._dynamo.utils import counters
from transformers import AutoModelForCausalLM, GPT2Config

from bem import HierarchicalBEMConfig, create_hierarchical_bem


def main() -> None:
    torch.manual_seed(0)
    config = GPT2Config(n_embd=768, n_layer=12, n_head=12, vocab_size=50257, n_positions=1024)
    base = AutoModelForCausalLM.from_config(config).to("cuda", torch.bfloat16).eval()
    models = {"base": base}
    if "--bem" in sys.argv:
        models = {"bem": create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, attach_qkv=True))}
    for name, model in models.items():
        for batch in (1, 16):
            ids = torch.randint(3, 50000, (batch, 128), device="cuda")
            for call in range(4):
                for new in (32, 1):
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new, min_new_tokens=new,
                                   do_sample=False, pad_token_id=0, cache_implementation="static")
                    torch.cuda.synchronize()
                    print(f"{name} b{batch} call {call} new {new}: {1e3 * (time.perf_counter() - start):.1f} ms "
                          f"{dict(counters['stats'])}", flush=True)


if __name__ == "__main__":
    main()
