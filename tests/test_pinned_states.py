"""Static caches' BEM states keep their addresses from one `generate` call to the next, as the compiled decoding
step's CUDA graphs need (they read the state where they were recorded), and two static caches alive at once
never share a state's tensors."""

from __future__ import annotations

import gc

import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.cache_state import get_state
from bem.call_inputs import returned_cache

from conftest import random_ids, randomize_bem


def addresses(cache) -> set[int]:
    return {t.data_ptr() for part in get_state(cache).parts.values() for t in part.tensors()}


def static_generate(model, ids):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=4, do_sample=False,
                         pad_token_id=0, cache_implementation="static", return_dict_in_generate=True,
                         output_logits=True)
    return out.sequences, torch.stack(out.logits, 1), returned_cache(out)


def test_a_new_static_cache_reuses_the_state_of_one_that_is_gone_and_never_of_one_alive(load_base):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(
        rank=4, chunk_size=3, max_prefix_tokens=5, controller_dim=16, mixer="mlstm", mixer_dim=16, mixer_heads=2))
    randomize_bem(model, seed=1)
    first_ids, second_ids = random_ids(2, 7, seed=2), random_ids(2, 7, seed=3)
    expected = model.generate(second_ids, attention_mask=torch.ones_like(second_ids), max_new_tokens=4,
                              do_sample=False, pad_token_id=0, return_dict_in_generate=True, output_logits=True)

    _, _, first = static_generate(model, first_ids)
    _, _, second = static_generate(model, second_ids)
    assert get_state(first).pinned and get_state(second).pinned
    assert not addresses(first) & addresses(second)  # both alive: nothing shared
    kept = addresses(first)

    del first
    gc.collect()
    sequences, logits, third = static_generate(model, second_ids)
    assert addresses(third) == kept  # the state of the cache that is gone, reused in place
    assert torch.equal(sequences, expected.sequences)
    assert (logits - torch.stack(expected.logits, 1)).abs().max().item() < 1e-5
    assert not addresses(third) & addresses(second)
