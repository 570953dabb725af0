"""Sequence-mixer blocks (Hyena, mLSTM) bolted onto wrapped models: exact at init, causal, cached generation
equal to the full forward, padding excluded, removable, saved and loaded with the adapter, bad values refused."""

from __future__ import annotations

import pytest
import torch

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from bem.call_inputs import CACHE_KEYWORD, returned_cache

from conftest import DECODERS, random_ids, randomize_bem

MIXERS = ["hyena", "mlstm"]


def mixer_config(kind: str, **overrides) -> HierarchicalBEMConfig:
    fields = dict(rank=4, alpha=8.0, chunk_size=3, max_prefix_tokens=5, controller_dim=16, mixer=kind, mixer_dim=16,
                  mixer_heads=2, mixer_max_length=64)
    fields.update(overrides)
    return HierarchicalBEMConfig(**fields)


def randomized(model, seed: int = 0, scale: float = 0.3):
    """Every BEM and mixer parameter random, the mixers' output projections too (they start at zero). At the
    default scale the update outweighs the base model; the exactness tests run such models in float64."""
    randomize_bem(model, seed=seed, scale=scale)
    generator = torch.Generator().manual_seed(seed + 100)
    with torch.no_grad():
        for name, param in model.mixers.named_parameters():
            if "out_proj" in name or "in_proj" in name:
                param.copy_(torch.randn(param.shape, generator=generator) * scale)
    return model


def logits(model, ids, **kwargs):
    return model(input_ids=ids, **kwargs).logits


def cached_logits(model, ids, prompt: int):
    """The logits of `ids` from the cache: the first `prompt` tokens in one call, then one token a call."""
    out = model(input_ids=ids[:, :prompt], use_cache=True)
    pieces, cache = [out.logits], returned_cache(out)
    for t in range(prompt, ids.shape[1]):
        out = model(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True)
        pieces.append(out.logits)
        cache = returned_cache(out)
    return torch.cat(pieces, 1)


@pytest.mark.parametrize("kind", MIXERS)
@pytest.mark.parametrize("arch", DECODERS)
def test_a_fresh_mixer_leaves_the_base_model_exact_and_disable_and_unload_remove_it(arch, kind, load_base):
    base = load_base(arch)
    ids = random_ids(2, 11)
    expected = logits(base, ids)
    model = create_hierarchical_bem(base, mixer_config(kind))
    assert len(model.mixers) == 2  # "all" blocks of the tiny models
    assert torch.equal(logits(model, ids), expected)
    randomized(model)
    assert not torch.allclose(logits(model, ids), expected)
    with model.disable_bem():
        assert torch.equal(logits(model, ids), expected)
    bare = model.unload()
    assert torch.equal(logits(bare, ids), expected)
    assert not any(block._forward_hooks for block in bare.modules() if hasattr(block, "_forward_hooks")
                   and block._forward_hooks)


def test_no_mixer_changes_nothing(load_base):
    plain = create_hierarchical_bem(load_base("llama"), mixer_config(None))
    assert len(plain.mixers) == 0
    assert not any(key.startswith("mixers.") for key in plain.bem_state_dict())
    assert "mixers" not in dict(plain.named_children()) or not list(plain.mixers.parameters())


@pytest.mark.parametrize("kind", MIXERS)
@pytest.mark.parametrize("arch", DECODERS)
def test_cached_decoding_equals_the_full_forward(arch, kind, load_base):
    # float64: the cached path and the full forward differ only by rounding, so any real mismatch stands out
    model = randomized(create_hierarchical_bem(load_base(arch), mixer_config(kind)), seed=1).double()
    ids = random_ids(2, 17, seed=2)
    full = logits(model, ids)
    assert (cached_logits(model, ids, prompt=7) - full).abs().max().item() < 1e-10


@pytest.mark.parametrize("kind", MIXERS)
@pytest.mark.parametrize("arch", ["llama", "qwen2", "gpt2"])
def test_cached_decoding_in_float32_is_within_1e_5_of_the_full_forward(arch, kind, load_base):
    """In float32, with an update that moves the logits about as much as the base sets them (a milder
    randomization than the float64 tests', whose update is several times the base's output)."""
    model = create_hierarchical_bem(load_base(arch), mixer_config(kind))
    ids = random_ids(2, 17, seed=2)
    plain = logits(model, ids)
    randomized(model, seed=1, scale=0.1)
    full = logits(model, ids)
    assert (full - plain).abs().max().item() > 0.1  # the update and the mixers matter
    assert (cached_logits(model, ids, prompt=7) - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("kind", MIXERS)
def test_a_continuation_of_several_tokens_equals_the_full_forward(kind, load_base):
    model = randomized(create_hierarchical_bem(load_base("llama"), mixer_config(kind)), seed=3).double()
    ids = random_ids(2, 16, seed=4)
    full = logits(model, ids)
    out = model(input_ids=ids[:, :6], use_cache=True)
    second = model(input_ids=ids[:, 6:11], **{CACHE_KEYWORD: returned_cache(out)}, use_cache=True)
    third = model(input_ids=ids[:, 11:], **{CACHE_KEYWORD: returned_cache(second)}, use_cache=True)
    assert (torch.cat([out.logits, second.logits, third.logits], 1) - full).abs().max().item() < 1e-10


@pytest.mark.parametrize("kind", MIXERS)
def test_a_future_token_never_changes_the_past(kind, load_base):
    model = randomized(create_hierarchical_bem(load_base("qwen2"), mixer_config(kind)), seed=5).double()
    ids = random_ids(1, 14, seed=6)
    reference = logits(model, ids)
    for t in (0, 5, 11):
        changed = ids.clone()
        changed[0, t + 1] = (changed[0, t + 1] + 7) % 90 + 3
        out = logits(model, changed)
        assert torch.allclose(out[:, : t + 1], reference[:, : t + 1], atol=1e-12, rtol=0), t
        assert not torch.allclose(out[:, t + 1 :], reference[:, t + 1 :], atol=1e-6), t


@pytest.mark.parametrize("kind", MIXERS)
@pytest.mark.parametrize("arch", ["llama", "gpt2"])
def test_a_left_padded_row_gives_what_it_gives_alone(arch, kind, load_base):
    model = randomized(create_hierarchical_bem(load_base(arch), mixer_config(kind)), seed=7).double()
    rows = [random_ids(1, n, seed=n)[0] for n in (12, 5, 9)]
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for i, row in enumerate(rows):
        ids[i, length - len(row):], mask[i, length - len(row):] = row, 1
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = logits(model, ids, attention_mask=mask, position_ids=positions)
    for i, row in enumerate(rows):
        alone = logits(model, row[None], position_ids=torch.arange(len(row))[None])
        assert (batched[i, -len(row):] - alone[0]).abs().max().item() < 1e-10, i


@pytest.mark.parametrize("mode", ["greedy", "sample", "beam"])
@pytest.mark.parametrize("kind", MIXERS)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32], ids=["float64", "float32"])
def test_cached_generate_equals_generate_without_a_cache(kind, mode, dtype, load_base):
    # float32 within 1e-5, with the milder randomization of the float32 decoding test; float64 within 1e-10
    scale, tolerance = (0.3, 1e-10) if dtype == torch.float64 else (0.1, 1e-5)
    model = randomized(create_hierarchical_bem(load_base("llama"), mixer_config(kind)), seed=8, scale=scale).to(dtype)
    ids = random_ids(2, 6, seed=9)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=7, pad_token_id=0, return_dict_in_generate=True,
                  output_logits=True)
    kwargs.update({"greedy": dict(do_sample=False), "sample": dict(do_sample=True, top_k=0),
                   "beam": dict(num_beams=3, do_sample=False)}[mode])
    results = []
    for options in ({"use_cache": False}, {}, {"cache_implementation": "static"}):
        torch.manual_seed(0)
        results.append(model.generate(ids, **options, **kwargs))
    for out in results[1:]:
        assert torch.equal(out.sequences, results[0].sequences)
        assert (torch.stack(out.logits) - torch.stack(results[0].logits)).abs().max().item() < tolerance


@pytest.mark.parametrize("kind", MIXERS)
def test_saved_and_loaded_with_the_adapter(kind, load_base, tmp_path, capsys):
    model = randomized(create_hierarchical_bem(load_base("gpt_neox"), mixer_config(kind, mixer_layers=[-1])), seed=10)
    assert list(model.mixers) == ["1"]
    ids = random_ids(2, 9, seed=11)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    from safetensors.torch import load_file

    saved = load_file(str(tmp_path / "adapter_model.safetensors"))
    assert any(key.startswith("mixers.1.mixer.") for key in saved)
    loaded = BEMModel.from_pretrained(load_base("gpt_neox"), tmp_path)
    assert torch.equal(logits(loaded, ids), expected)
    model.print_trainable_parameters()
    mixers = sum(p.numel() for p in model.mixers.parameters())
    assert f"of which mixers: {mixers:,d}" in capsys.readouterr().out


@pytest.mark.parametrize("kind", MIXERS)
def test_the_mixers_train(kind, load_base):
    model = create_hierarchical_bem(load_base("llama"), mixer_config(kind))
    model.train()
    ids = random_ids(2, 12, seed=12)
    model(input_ids=ids, labels=ids).loss.backward()
    grads = {name: p.grad for name, p in model.mixers.named_parameters()}
    assert grads["0.out_proj.weight"].abs().sum() > 0  # the only path to the loss at init
    optimizer = torch.optim.SGD(model.adapter_parameters(), lr=0.1)
    optimizer.step()
    optimizer.zero_grad()
    model(input_ids=ids, labels=ids).loss.backward()
    inner = [name for name, p in model.mixers.named_parameters() if p.grad is not None and p.grad.abs().sum() > 0]
    assert any(".mixer." in name for name in inner)  # once W_out moved, the mixer itself learns


@pytest.mark.parametrize("kind", MIXERS)
def test_half_precision_with_extreme_gates_stays_finite(kind, load_base):
    for dtype in (torch.float16, torch.bfloat16):
        model = randomized(create_hierarchical_bem(load_base("llama").to(dtype), mixer_config(kind)), seed=13)
        if kind == "mlstm":
            for block in model.mixers.values():
                with torch.no_grad():
                    block.mixer.gates.weight.copy_(torch.randn_like(block.mixer.gates.weight) * 100)
                    block.mixer.gates.bias.uniform_(-30, 30)
        ids = random_ids(2, model.bem_config.mixer_max_length, seed=14)  # the longest sequence a Hyena filter takes
        with torch.no_grad():
            assert torch.isfinite(logits(model, ids).float()).all(), dtype


def test_a_hyena_sequence_longer_than_its_filter_is_refused(load_base):
    model = create_hierarchical_bem(load_base("llama"), mixer_config("hyena", mixer_max_length=10))
    with pytest.raises(ValueError, match="reach position 12, but the Hyena mixers' filters cover mixer_max_length = 10"):
        model(input_ids=random_ids(1, 12))
    out = model(input_ids=random_ids(1, 10), use_cache=True)
    with pytest.raises(ValueError, match="reach position 11"):
        model(input_ids=random_ids(1, 1), **{CACHE_KEYWORD: returned_cache(out)}, use_cache=True)
    with pytest.raises(ValueError, match="static cache holds up to"):
        model.generate(random_ids(1, 6), max_new_tokens=8, do_sample=False, pad_token_id=0,
                       cache_implementation="static")


@pytest.mark.parametrize("fields,message", [
    (dict(mixer="hyenna"), r"mixer must be null, 'hyena' or 'mlstm', got 'hyenna' \(did you mean 'hyena'\?\)"),
    (dict(mixer="mlstm", mixer_layers=[]), "mixer_layers must be 'all' or a non-empty list"),
    (dict(mixer="mlstm", mixer_layers="first"), "mixer_layers must be 'all'"),
    (dict(mixer="mlstm", mixer_layers=[0, True]), "mixer_layers must be 'all'"),
    (dict(mixer="mlstm", mixer_layers=[1, 1]), "mixer_layers names a block twice"),
    (dict(mixer="mlstm", mixer_dim=0), r"mixer_dim must be an integer in \[1, 65536\], got 0"),
    (dict(mixer="mlstm", mixer_dim=30, mixer_heads=4), r"mixer_dim \(30\) must be a multiple of mixer_heads \(4\)"),
    (dict(mixer="hyena", mixer_max_length=2**21), r"mixer_max_length must be an integer in \[1, 1048576\]"),
    (dict(mixer="hyena", mixer_conv_size=0), "mixer_conv_size must be an integer"),
    (dict(mixer="mlstm", mixer_forget_bias="high"), "mixer_forget_bias must be a finite number"),
    (dict(mixer="mlstm", mixer_input_bias=float("inf")), "mixer_input_bias must be a finite number"),
])
def test_bad_mixer_settings_are_refused_naming_the_field(fields, message):
    with pytest.raises(ValueError, match=message):
        HierarchicalBEMConfig(**fields)


def test_a_block_index_the_model_lacks_is_refused(load_base):
    with pytest.raises(ValueError, match=r"mixer_layers has block index 2, but this model has 2 blocks"):
        create_hierarchical_bem(load_base("llama"), mixer_config("mlstm", mixer_layers=[0, 2]))
    with pytest.raises(ValueError, match="names a block twice"):
        create_hierarchical_bem(load_base("llama"), mixer_config("mlstm", mixer_layers=[1, -1]))


def test_mixers_cannot_be_merged_or_exported_as_lora(load_base, tmp_path):
    model = create_hierarchical_bem(load_base("llama"), mixer_config("hyena", enable_routing=False))
    with pytest.raises(ValueError, match="mixer blocks, which are layers of their own"):
        model.merge_and_unload()
    with pytest.raises(ValueError, match="mixer blocks, which a LoRA adapter cannot express"):
        model.save_as_peft_lora(tmp_path)


@pytest.mark.parametrize("kind", MIXERS)
def test_mixers_without_routing_still_follow_the_cache(kind, load_base):
    model = randomized(create_hierarchical_bem(load_base("gpt2"), mixer_config(kind, enable_routing=False)), seed=15).double()
    assert model.controller is None
    ids = random_ids(2, 12, seed=16)
    full = logits(model, ids)
    generated = model.generate(ids[:, :5], max_new_tokens=4, do_sample=False, pad_token_id=0)
    out = model(input_ids=ids[:, :5], use_cache=True)
    step = model(input_ids=ids[:, 5:6], **{CACHE_KEYWORD: returned_cache(out)}, use_cache=True)
    assert (step.logits[:, -1] - full[:, 5]).abs().max().item() < 1e-10
    assert generated.shape == (2, 9)


@pytest.mark.parametrize("kind", MIXERS)
def test_generate_compiles_the_decoding_step_of_a_model_with_mixers(kind, load_base):
    """Static cache plus generate's compiled step (forced on the CPU, traced in one graph): the mixers' decode
    states advance in place at fixed addresses, and the tokens and logits are those of eager decoding."""
    from transformers import CompileConfig

    torch._dynamo.reset()
    model = randomized(create_hierarchical_bem(load_base("llama"), mixer_config(kind)), seed=17).double()
    ids = random_ids(2, 6, seed=18)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    kwargs = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, pad_token_id=0,
                  return_dict_in_generate=True, output_logits=True)
    eager = model.generate(ids, **kwargs)
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    compiled = model.generate(ids, cache_implementation="static", compile_config=config, **kwargs)
    assert torch.equal(compiled.sequences, eager.sequences)
    assert (torch.stack(compiled.logits) - torch.stack(eager.logits)).abs().max().item() < 1e-10
