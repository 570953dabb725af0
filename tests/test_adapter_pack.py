"""generate's compiled decoding step reads every wrapped layer's V and U from one buffer (`AdapterPack`), and
that buffer never lags behind the parameters."""

from __future__ import annotations

import copy

import pytest
import torch
from transformers import CompileConfig

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.modules.adapter_pack import ALIGN, AdapterPack

from conftest import random_ids, randomize_bem
from test_decoding_paths import full_forward_greedy, generate, left_padded


def wrapped(load_base, seed: int):
    model = create_hierarchical_bem(load_base("llama"), HierarchicalBEMConfig(
        rank=3, alpha=6.0, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True))
    randomize_bem(model, seed=seed)
    return model


def adapter_parameters(model) -> list[torch.Tensor]:
    return [p for _, m in model.bem_modules() for p in (m.bem_V, m.bem_U)]


def compiled_generate(model, ids, mask, graphs: list):
    """generate with a static cache and its compiled decoding step, recording each graph's example inputs."""

    def recording(gm, example_inputs, **options):  # generate passes its compile options (mode, ...) on
        graphs.append(list(example_inputs))
        return gm.forward

    config = CompileConfig(backend=recording, fullgraph=True)
    config._compile_all_devices = True
    return generate(model, ids, mask, cache_implementation="static", compile_config=config)


def assert_compiled_generate_is_exact(model, ids, mask) -> list:
    """generate's compiled step gives the full forward's tokens and logits; returns the graphs' inputs."""
    expected, expected_logits = full_forward_greedy(model, ids, mask)
    graphs: list = []
    tokens, logits = compiled_generate(model, ids, mask, graphs)
    assert torch.equal(tokens, expected)
    assert (logits - expected_logits).abs().max().item() < 1e-5
    assert graphs, "generate compiled no decoding step"
    return graphs


def test_the_compiled_step_takes_the_pack_instead_of_each_v_and_u(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=1)
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=2))
    storages = {t.untyped_storage().data_ptr() for t in graphs[-1] if isinstance(t, torch.Tensor)}
    adapters = {p.untyped_storage().data_ptr() for p in adapter_parameters(model)}
    assert not storages & adapters, "a wrapped layer's V or U is still an input of its own"
    assert model._pack.flat.untyped_storage().data_ptr() in storages
    # the pack belongs to the running generate only: a user's own compiled forward reads the parameters
    assert model.context.pack is None and model.context.weights is None


def test_the_pack_follows_parameters_written_in_place_or_replaced(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=3)
    ids, mask = left_padded(seed=4)
    compiled_generate(model, ids, mask, [])
    (_, first), (_, last) = model.bem_modules()[0], model.bem_modules()[-1]
    with torch.no_grad():
        first.bem_U.add_(0.5)  # as an optimizer step writes
    last.bem_V.data = torch.randn_like(last.bem_V)  # a new tensor behind the same parameter
    assert_compiled_generate_is_exact(model, ids, mask)


def test_adapters_of_mixed_dtypes_are_not_packed_and_generate_stays_exact(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=5)
    _, module = model.bem_modules()[2]
    module.bem_V.data = module.bem_V.data.double()
    module.bem_U.data = module.bem_U.data.double()
    assert model._adapter_pack() is None
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=6))
    storages = {t.untyped_storage().data_ptr() for t in graphs[-1] if isinstance(t, torch.Tensor)}
    assert module.bem_V.untyped_storage().data_ptr() in storages  # read as the parameter it is


def test_pack_layout_is_aligned_and_holds_the_parameters():
    modules = []
    for K, N, r in [(5, 7, 3), (64, 1, 3), (1, 130, 3)]:
        m = torch.nn.Module()
        m.bem_V = torch.nn.Parameter(torch.randn(K, r))
        m.bem_U = torch.nn.Parameter(torch.randn(N, r))
        modules.append(m)
    pack = AdapterPack(modules)
    assert pack.refresh()
    for (V, U, joint), m, (v_at, K, u_at, N, r) in zip(pack.weights(), modules, pack.layout):
        assert joint is None  # no base layer to join with
        assert v_at % ALIGN == 0 and u_at % ALIGN == 0
        assert torch.equal(V, m.bem_V) and torch.equal(U, m.bem_U)
    flat = pack.flat
    assert pack.refresh() and pack.flat is flat  # nothing changed: the same buffer, not copied again
    with torch.no_grad():
        modules[1].bem_U.mul_(2)
    assert pack.refresh() and pack.flat is flat
    assert torch.equal(pack.weights()[1][1], modules[1].bem_U)
    # replaced in two steps, the old storage let go in between: its address may not come back unnoticed
    modules[0].bem_V.data = torch.empty(0)
    modules[0].bem_V.data = torch.randn(5, 3)
    assert pack.refresh() and torch.equal(pack.weights()[0][0], modules[0].bem_V)


def test_no_pack_without_plain_floating_adapters_or_modules():
    """Integer, flattened (as a sharding wrapper leaves them) or rank-mismatched adapters are not packed."""
    assert not AdapterPack([]).refresh()

    def module(V: torch.Tensor, U: torch.Tensor) -> torch.nn.Module:
        m = torch.nn.Module()
        m.bem_V = torch.nn.Parameter(V, requires_grad=V.is_floating_point())
        m.bem_U = torch.nn.Parameter(U, requires_grad=U.is_floating_point())
        return m

    assert not AdapterPack([module(torch.zeros(4, 2, dtype=torch.int32), torch.zeros(4, 2, dtype=torch.int32))]).refresh()
    assert not AdapterPack([module(torch.zeros(8), torch.zeros(4, 2))]).refresh()
    assert not AdapterPack([module(torch.zeros(4, 2), torch.zeros(4, 3))]).refresh()
    pack = AdapterPack([module(torch.zeros(4, 2), torch.zeros(4, 2))])
    assert pack.refresh() and pack.flat is not None


@pytest.mark.parametrize("how", ["deepcopy", "state"])
def test_a_copied_model_starts_without_the_running_pack(how, load_base):
    model = wrapped(load_base, seed=7)
    model.context.pack = model._adapter_pack()
    model.context.weights = model.context.pack.weights()
    state = model.context.__getstate__()
    assert state["pack"] is None and state["weights"] is None
    if how == "deepcopy":
        copied = copy.deepcopy(model)
        assert copied.context.pack is None and copied.context.weights is None
    model.context.pack = model.context.weights = None
