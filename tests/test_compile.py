"""The wrapped model compiles as one graph (no breaks from BEM's hooks), with and without a KV cache."""

from __future__ import annotations

import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.call_inputs import CACHE_KEYWORD, returned_cache

from conftest import random_ids, randomize_bem


def test_fullgraph_compile_matches_eager_including_cached_decoding(load_base):
    torch._dynamo.reset()
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4, chunk_size=3, controller_dim=16))
    randomize_bem(model, seed=21)
    ids = random_ids(2, 9, seed=22)
    expected = model(input_ids=ids, use_cache=False).logits
    compiled = torch.compile(model, fullgraph=True, dynamic=False)
    out = compiled(input_ids=ids[:, :6], use_cache=True)
    pieces, cache = [out.logits], returned_cache(out)
    for t in range(6, 9):
        out = compiled(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True)
        pieces.append(out.logits)
        cache = returned_cache(out)
    assert (torch.cat(pieces, dim=1) - expected).abs().max().item() < 1e-5
