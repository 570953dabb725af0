"""What a wrapped linear adds to the guards of generate's compiled decoding step.

Dynamo checks every guard of a compiled call on every call, on the host: a decoding step of a model with a
hundred wrapped linears pays for each guard a wrapped linear adds a hundred times. A wrapped linear reads its
constants as one tuple and calls module functions, not methods (each method looked up on a module is a guard
that the instance does not shadow it)."""

from __future__ import annotations

import torch
from torch._dynamo.eval_frame import _debug_get_cache_entry_list

from conftest import TINY_CONFIGS
from test_adapter_pack import compiled_generate, wrapped
from test_decoding_paths import left_padded


def _children(manager) -> list:
    children = list(manager.get_child_managers())
    if hasattr(manager, "get_key_value_managers"):  # a dict's: its entries' key and value managers
        children += [m for pair in manager.get_key_value_managers().values() for m in pair if m is not None]
    return children


def _leaf_guards(manager, counts: dict[str, int]) -> int:
    """The leaf guards under `manager`; counts gets each manager's, by its source."""
    total = len(manager.get_leaf_guards()) + sum(_leaf_guards(child, counts) for child in _children(manager))
    counts[manager.get_source()] = total
    return total


def _guards_by_source(model) -> dict[str, int]:
    torch._dynamo.reset()
    compiled_generate(model, *left_padded(seed=2), [])
    # generate compiles the model's __call__, whose first frame dynamo does not skip is the forward of the
    # causal LM module (or the function its class decorated)
    codes = {type(module).forward.__code__ for module in model.modules()}
    entries = [entry for code in codes for entry in _debug_get_cache_entry_list(code)]
    assert len(entries) == 1, f"{len(entries)} compiled frames"
    counts: dict[str, int] = {}
    _leaf_guards(entries[0].guard_manager.root, counts)
    return counts


def _q_proj(counts: dict[str, int]) -> int:
    matching = [source for source in counts if source.endswith("._modules['q_proj']")]
    assert matching, "no guard manager for a q_proj in the compiled step's guards"
    return counts[matching[0]]


def test_a_wrapped_linear_adds_few_guards_to_the_compiled_step(load_base):
    base_guards = _q_proj(_guards_by_source(load_base("llama")))
    bem_guards = _q_proj(_guards_by_source(wrapped(load_base, seed=1)))
    # nn.Linear's: its type, its forward not shadowed, its parameters' dict, weight and bias (6 here). BEMLinear
    # adds its constants' tuple (an equality, its type and its length) and the base layer read through _modules
    # (6 more); with a guard for each constant and each method looked up, it added 12
    assert bem_guards - base_guards <= 7, (base_guards, bem_guards)


def _all_leaf_guards(model) -> int:
    return max(_guards_by_source(model).values())  # the root's count: every leaf guard under it


def _llama(layers: int):
    from transformers import LlamaForCausalLM

    config = TINY_CONFIGS["llama"]()
    config.num_hidden_layers = layers
    torch.manual_seed(0)
    return LlamaForCausalLM(config).eval()


def test_each_layer_adds_about_as_many_guards_as_the_bases_layer():
    """The guards a decoding step checks on the host grow with depth: BEM's per layer (seven wrapped linears, their
    joint buffers) stay within a few of the base's, so a deep model pays for BEM's fixed few hundred only once."""

    def per_layer(make) -> float:
        shallow, deep = (_all_leaf_guards(make(_llama(layers))) for layers in (2, 4))
        return (deep - shallow) / 2

    base = per_layer(lambda model: model)
    bem = per_layer(lambda model: wrapped(lambda _arch: model, seed=1))
    # 91 and 99 when written; a guard for each wrapped linear (a bias read where there is none, a list item) adds 7
    assert bem - base <= 10, (base, bem)
