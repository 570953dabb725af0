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


def test_compiled_inference_reads_the_codes_from_one_buffer(load_base):
    """A compiled no-grad call hands the layers their codes through `bem::codes_buffer` (once per controller
    call), so that inductor computes the codes once instead of once per wrapped module; with autograd the codes
    go straight on."""
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(rank=4, chunk_size=3, controller_dim=16))
    randomize_bem(model, seed=23)
    ids = random_ids(2, 7, seed=24)
    graphs = []

    def recording(gm, example_inputs):
        graphs.append(gm)
        return gm.forward

    def buffers_in_last_graph() -> int:
        return sum(node.target is torch.ops.bem.codes_buffer.default for node in graphs[-1].graph.nodes)

    expected = model(input_ids=ids, use_cache=False).logits
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording, fullgraph=True, dynamic=False)
    with torch.no_grad():
        logits = compiled(input_ids=ids, use_cache=False).logits
    assert buffers_in_last_graph() == 1
    assert torch.equal(logits, expected.detach()) or (logits - expected).abs().max().item() < 1e-6
    torch._dynamo.reset()
    compiled = torch.compile(model, backend=recording, fullgraph=True, dynamic=False)
    compiled(input_ids=ids, use_cache=False)
    assert buffers_in_last_graph() == 0
    torch._dynamo.reset()
