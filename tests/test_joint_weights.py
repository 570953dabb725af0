"""generate's compiled decoding step computes each plain linear as one GEMM of [W; Vᵀ] plus a fused expand
(`bem.modules.joint_weights`): exact, W never held twice, and the buffers follow weights and V as they change."""

from __future__ import annotations

import pytest
import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.modules.joint_weights import ROW_ALIGN, joint_linear, joinable

from conftest import randomize_bem
from test_adapter_pack import assert_compiled_generate_is_exact
from test_decoding_paths import left_padded


def wrapped(load_base, arch: str = "llama", seed: int = 0, rank: int = 3):
    model = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(
        rank=rank, alpha=2.0 * rank, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True))
    randomize_bem(model, seed=seed)
    return model


def graph_storages(graphs: list) -> set[int]:
    return {t.untyped_storage().data_ptr() for t in graphs[-1] if isinstance(t, torch.Tensor)}


@pytest.mark.parametrize("with_codes", [True, False])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("rank", [1, 3, 8, 13])
def test_joint_linear_matches_the_float64_reference(rank, with_bias, with_codes):
    generator = torch.Generator().manual_seed(rank)
    N, K, R = 37, 29, -(-rank // ROW_ALIGN) * ROW_ALIGN
    x = torch.randn(2, 5, K, generator=generator, dtype=torch.float64)
    W, V = torch.randn(N, K, generator=generator, dtype=torch.float64), torch.randn(K, rank, generator=generator,
                                                                                      dtype=torch.float64)
    U = torch.randn(N, rank, generator=generator, dtype=torch.float64)
    bias = torch.randn(N, generator=generator, dtype=torch.float64) if with_bias else None
    codes = torch.randn(2, 5, rank, generator=generator, dtype=torch.float64) if with_codes else None
    joint = torch.cat([W, V.t(), torch.full((R - rank, K), float("nan"), dtype=torch.float64)])
    # the padding rows hold NaN here: the expand must never read past the rank
    expected = x @ W.t() + 1.5 * ((x @ V) * (1.0 if codes is None else codes)) @ U.t()
    if bias is not None:
        expected = expected + bias
    out = joint_linear(x, joint, N, bias, codes, U, 1.5)
    assert out.shape == expected.shape
    assert torch.allclose(out, expected, rtol=1e-12, atol=1e-12)


def test_the_compiled_step_reads_joint_buffers_and_keeps_no_second_weight(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, seed=1)
    graphs = assert_compiled_generate_is_exact(model, *left_padded(seed=2))
    joints = model._pack.joint_weights.joints
    modules = [module for _, module in model.bem_modules()]
    assert all(joint is not None for joint in joints), "every llama projection is a plain nn.Linear"
    storages = graph_storages(graphs)
    for module, joint in zip(modules, joints):
        weight, V = module.base_layer.weight, module.bem_V
        N, K = weight.shape
        assert joint.shape == (N + ROW_ALIGN, K)  # rank 3 padded to 8 rows
        assert weight.data_ptr() == joint.data_ptr(), "the weight is not a view of its joint buffer"
        assert weight.untyped_storage().nbytes() == joint.numel() * joint.element_size()
        assert torch.equal(joint[N:N + 3], V.detach().t()) and not joint[N + 3:].any()
        assert joint.untyped_storage().data_ptr() in storages


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
    joints = model._pack.joint_weights.joints
    assert first.base_layer.weight.data_ptr() == joints[0].data_ptr()
    N = last.base_layer.weight.shape[0]
    assert torch.equal(joints[-1][N:N + 3], last.bem_V.detach().t())


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
    joints = model._pack.joint_weights.joints
    assert joints[q] is None and joints[o] is None
    assert all(joint is not None for index, joint in enumerate(joints) if index not in (q, o))
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
