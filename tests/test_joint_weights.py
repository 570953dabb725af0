"""generate's compiled decoding step computes each plain linear as one GEMM of [W; Vᵀ] plus a fused expand
(`bem.modules.joint_weights`): exact, W never held twice, and the buffers follow weights and V as they change."""

from __future__ import annotations

import pytest
import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.modules.joint_weights import ROW_ALIGN, JointSlot, input_groups, joint_linear, joinable

from conftest import randomize_bem
from test_adapter_pack import assert_compiled_generate_is_exact
from test_decoding_paths import full_forward_greedy, generate, left_padded


def wrapped(load_base, arch: str = "llama", seed: int = 0, rank: int = 3):
    model = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(
        rank=rank, alpha=2.0 * rank, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True))
    randomize_bem(model, seed=seed)
    return model


def graph_storages(graphs: list) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in graphs[-1] if isinstance(t, torch.Tensor)}


def group_buffer(weights, Vs, rank_total):
    """[W_1; ...; V_1ᵀ; ...] with NaN in the padding rows: the expand must never read past a layer's rank."""
    pad = -(-rank_total // ROW_ALIGN) * ROW_ALIGN - rank_total
    K = weights[0].shape[1]
    return torch.cat([*weights, *(V.t() for V in Vs), torch.full((pad, K), float("nan"), dtype=weights[0].dtype)])


@pytest.mark.parametrize("apart", [False, True], ids=["fused-expand", "expand-apart"])
@pytest.mark.parametrize("with_codes", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("rank", [1, 3, 8, 13])
def test_joint_linear_matches_the_float64_reference(rank, with_bias, with_codes, apart):
    generator = torch.Generator().manual_seed(rank)
    randn = lambda *shape: torch.randn(*shape, generator=generator, dtype=torch.float64)  # noqa: E731
    K, sizes, ranks = 29, (37, 11, 13), (rank, rank + 2, 1)  # a group of three layers, e.g. q, k and v
    Ws, Vs = [randn(N, K) for N in sizes], [randn(K, r) for r in ranks]
    Us = [randn(N, r) for N, r in zip(sizes, ranks)]
    biases = [randn(N) if with_bias else None for N in sizes]
    buffer, memo = group_buffer(Ws, Vs, sum(ranks)), {}
    starts, h_starts = (0, 37, 48), (61, 61 + rank, 61 + 2 * rank + 2)
    for x in (randn(2, 5, K), randn(3, K)):  # the second input: the group's product is computed again
        for layer, (W, V, U, bias) in enumerate(zip(Ws, Vs, Us, biases)):
            codes = randn(*x.shape[:-1], V.shape[1]) if with_codes else None
            expected = x @ W.t() + 1.5 * ((x @ V) * (1.0 if codes is None else codes)) @ U.t()
            if bias is not None:
                expected = expected + bias
            slot = JointSlot(buffer, 0, starts[layer], W.shape[0], h_starts[layer], bias, memo, apart)
            out = joint_linear(x, slot, codes, U, 1.5)
            assert out.shape == expected.shape
            assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)
            assert memo[0][0] is x  # one product of the group per input


def test_input_groups_are_siblings_named_to_share_one_input():
    names = ["model.layers.0.self_attn.q_proj", "model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj",
             "model.layers.0.self_attn.o_proj", "model.layers.0.mlp.gate_proj", "model.layers.0.mlp.up_proj",
             "model.layers.0.mlp.down_proj", "model.layers.1.self_attn.q_proj", "model.layers.1.self_attn.v_proj"]
    assert input_groups(names) == [[0, 1, 2], [3], [4, 5], [6], [7, 8]]
    assert input_groups(names, grouped=False) == [[index] for index in range(len(names))]


def test_the_compiled_step_reads_joint_buffers_and_keeps_no_second_weight(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=1)
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=2))
    joint_weights = model._pack.joint_weights
    names = model.bem_module_names
    modules = [module for _, module in model.bem_modules()]
    assert all(where is not None for where in joint_weights.layout), "every llama projection is a plain nn.Linear"
    storages = graph_storages(graphs)
    layers = len(names) // 7
    assert len(joint_weights.joints) == 4 * layers  # q, k and v; o; gate and up; down
    for index, (module, where) in enumerate(zip(modules, joint_weights.layout)):
        group, start, N, h_start = where
        joint = joint_weights.joints[group]
        weight, V = module.base_layer.weight, module.bem_V
        assert N == weight.shape[0] and joint.shape[1] == weight.shape[1]
        assert weight.data_ptr() == joint[start].data_ptr(), "the weight is not a view of its joint buffer"
        assert weight.untyped_storage().nbytes() == joint.numel() * joint.element_size()
        assert torch.equal(joint[h_start:h_start + 3], V.detach().t())
        assert joint.untyped_storage().data_ptr() in storages
        leaf = names[index].rsplit(".", 1)[1]
        members = sum(1 for other in joint_weights.layout if other[0] == group)
        assert members == {"q_proj": 3, "k_proj": 3, "v_proj": 3, "gate_proj": 2, "up_proj": 2}.get(leaf, 1)
        # a layer alone (o, down: a residual branch) takes its expand as a product of its own
        assert joint_weights.slots({})[index].apart == (members == 1)
    for joint in joint_weights.joints.values():  # each group's rank rows padded to 8, the padding zero
        members = [m for m, where in zip(modules, joint_weights.layout) if joint_weights.joints[where[0]] is joint]
        rows = sum(m.base_layer.weight.shape[0] for m in members)
        assert joint.shape[0] == rows + -(-3 * len(members) // ROW_ALIGN) * ROW_ALIGN
        assert not joint[rows + 3 * len(members):].any()


def test_a_group_whose_layers_take_different_inputs_stays_exact(load_base):
    """A group is a guess from the names: layers grouped wrongly (here o_proj with q, k and v, which it shares no
    input with) compute the group's product again, and the answer does not change."""
    import bem.modules.joint_weights as joint_weights

    torch._dynamo.reset()
    model = wrapped(load_base, seed=15)
    shared = joint_weights.SHARED_INPUT
    try:
        # read when the first generate makes the model's adapter pack
        joint_weights.SHARED_INPUT = (("q_proj", "k_proj", "v_proj", "o_proj"), ("gate_proj", "up_proj", "down_proj"))
        assert_compiled_generate_is_exact(model, *left_padded(seed=16))
        layout = model._pack.joint_weights.layout
        assert layout[0][0] == layout[3][0], "o_proj joins q, k and v (one width here)"
        # down_proj's input is wider than gate's and up's: a buffer of its own
        assert len(model._pack.joint_weights.joints) == 3 * (len(model.bem_module_names) // 7)
    finally:
        joint_weights.SHARED_INPUT = shared


def compiled_linears(model, ids, mask) -> int:
    """generate's compiled step, checked against the full forward; the linear products its graph computes."""
    return compiled_products(model, ids, mask)[0]


def compiled_products(model, ids, mask) -> tuple[int, int]:
    """generate's compiled step, checked against the full forward; the linear products and the matrix products
    (`@`) its graph computes."""
    import operator

    from transformers import CompileConfig

    expected, expected_logits = full_forward_greedy(model, ids, mask)
    counts = []

    def counting(gm, example_inputs, **options):
        targets = [node.target for node in gm.graph.nodes if node.op == "call_function"]
        counts.append((sum(t in (torch._C._nn.linear, torch.nn.functional.linear) for t in targets),
                       sum(t in (operator.matmul, torch.matmul) for t in targets)))
        return gm.forward

    config = CompileConfig(backend=counting, fullgraph=True)
    config._compile_all_devices = True
    tokens, logits = generate(model, ids, mask, cache_implementation="static", compile_config=config)
    assert torch.equal(tokens, expected) and (logits - expected_logits).abs().max().item() < 1e-5
    return counts[-1]


def test_the_layers_alone_take_their_expand_as_a_product_of_their_own(load_base):
    """o and down (a residual branch, whose consumer is the next norm's reduction) expand through `@` U^T; the
    layers of a group through multiply-adds the compiler fuses into their pointwise consumers."""
    import bem.modules.joint_weights as joint_weights

    torch._dynamo.reset()
    model = wrapped(load_base, seed=23)
    ids, mask = left_padded(seed=24)
    layers = len(model.bem_module_names) // 7
    products = compiled_products(model, ids, mask)
    controller_products = products[1] - 2 * layers
    try:
        joint_weights.EXPAND_APART = False  # read as each compiled call is traced
        torch._dynamo.reset()
        assert compiled_products(model, ids, mask) == (products[0], controller_products)
    finally:
        joint_weights.EXPAND_APART = True


def test_turning_the_groups_off_between_generates_rehomes_every_weight(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=19)
    ids, mask = left_padded(seed=20)
    layers = len(model.bem_module_names) // 7
    grouped = compiled_linears(model, ids, mask)
    assert len(model._pack.joint_weights.joints) == 4 * layers
    model.joint_groups = False
    # q, k and v, and gate and up, were one product each: three a layer more now
    assert compiled_linears(model, ids, mask) == grouped + 3 * layers
    joint_weights = model._pack.joint_weights
    assert len(joint_weights.joints) == len(model.bem_module_names)
    for (_, module), (group, start, N, _) in zip(model.bem_modules(), joint_weights.layout):
        joint = joint_weights.joints[group]
        assert start == 0 and joint.shape[0] == N + ROW_ALIGN
        assert module.base_layer.weight.data_ptr() == joint.data_ptr()


def test_groups_off_gives_each_layer_a_buffer_of_its_own(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=17)
    model.joint_groups = False
    assert_compiled_generate_is_exact(model, *left_padded(seed=18))
    joint_weights = model._pack.joint_weights
    assert len(joint_weights.joints) == len(model.bem_module_names)
    assert [where[0] for where in joint_weights.layout] == list(range(len(model.bem_module_names)))


def test_a_replaced_weight_or_v_is_joined_again_and_generate_stays_exact(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=3)
    ids, mask = left_padded(seed=4)
    assert_compiled_generate_is_exact(model, ids, mask)
    (_, first), (_, last) = model.bem_modules()[0], model.bem_modules()[-1]
    first.base_layer.weight.data = first.base_layer.weight.detach().clone() * 1.5  # a weight loaded anew
    with torch.no_grad():
        last.bem_V.mul_(-2.0)  # an optimizer step
    assert_compiled_generate_is_exact(model, ids, mask)
    joint_weights = model._pack.joint_weights
    group, start, _, _ = joint_weights.layout[0]
    assert first.base_layer.weight.data_ptr() == joint_weights.joints[group][start].data_ptr()
    group, _, _, h_start = joint_weights.layout[-1]
    assert torch.equal(joint_weights.joints[group][h_start:h_start + 3], last.bem_V.detach().t())


def test_joint_weights_off_keeps_the_fused_path_exact(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=5)
    model.joint_weights = False
    weights = [module.base_layer.weight.data_ptr() for _, module in model.bem_modules()]
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=6))
    assert model._pack.joint_weights is None
    assert [module.base_layer.weight.data_ptr() for _, module in model.bem_modules()] == weights
    assert set(weights) <= graph_storages(graphs)  # the compiled step reads the weights themselves


def test_unload_gives_each_weight_a_storage_of_its_own_size(load_base):
    model = wrapped(load_base, seed=7)
    ids, mask = left_padded(seed=8)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    expected = model.base_model.get_submodule(model.bem_module_names[0]).base_layer.weight.detach().clone()
    base = model.unload()
    weight = base.get_submodule(model.bem_module_names[0]).weight
    assert torch.equal(weight, expected)
    assert weight.untyped_storage().nbytes() == weight.numel() * weight.element_size()


def test_conv1d_and_mixed_dtype_layers_are_not_joined(load_base):
    gpt2 = wrapped(load_base, "gpt2", seed=9)
    assert not any(joinable(module) for _, module in gpt2.bem_modules())
    llama = wrapped(load_base, seed=10)
    _, module = llama.bem_modules()[0]
    module.bem_V.data = module.bem_V.data.double()
    assert not joinable(module) and joinable(llama.bem_modules()[1][1])


def test_a_weight_two_wrapped_layers_share_is_not_joined(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=11)
    names = [name for name, _ in model.bem_modules()]
    q, o = names.index("model.layers.0.self_attn.q_proj"), names.index("model.layers.0.self_attn.o_proj")
    first, second = model.bem_modules()[q][1], model.bem_modules()[o][1]
    second.base_layer.weight = first.base_layer.weight  # q and o tied (both 32 x 32 here)
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=12))
    layout = model._pack.joint_weights.layout
    assert layout[q] is None and layout[o] is None
    assert all(where is not None for index, where in enumerate(layout) if index not in (q, o))
    assert layout[q + 1][0] == layout[q + 2][0]  # k and v still one group
    assert first.base_layer.weight is second.base_layer.weight
    assert first.base_layer.weight.untyped_storage().data_ptr() in graph_storages(graphs)


def test_the_base_saves_and_reloads_with_its_weights_in_joint_buffers(load_base, tmp_path):
    from transformers import AutoModelForCausalLM

    model = wrapped(load_base, seed=13)
    ids, mask = left_padded(seed=14)
    model.generate(ids, attention_mask=mask, max_new_tokens=2, do_sample=False, pad_token_id=0)
    name = model.bem_module_names[0]
    weight = model.base_model.get_submodule(name).base_layer.weight
    assert weight.untyped_storage().nbytes() > weight.numel() * weight.element_size()  # in its joint buffer
    base = model.unload()
    base.save_pretrained(tmp_path)
    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path)
    assert torch.equal(reloaded.get_submodule(name).weight, base.get_submodule(name).weight)
