"""Behaviour users rely on, for every supported architecture, on tiny 'pretrained' models."""

from __future__ import annotations

import pytest
import torch

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem
from bem.modules.bem_linear import BEMLinear
from bem.call_inputs import CACHE_KEYWORD, returned_cache

from conftest import ARCHITECTURES, DECODERS, random_ids, randomize_bem

ALL_ATTACH = dict(attach_mlp=True, attach_attention=True, attach_qkv=True)


def small_config(**overrides) -> HierarchicalBEMConfig:
    fields = dict(rank=4, alpha=8.0, chunk_size=4, max_prefix_tokens=6, controller_dim=16, **ALL_ATTACH)
    fields.update(overrides)
    return HierarchicalBEMConfig(**fields)


def logits(model, ids, **kwargs):
    return model(input_ids=ids, **kwargs).logits


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_init_is_exactly_the_base_model(arch, load_base):
    base = load_base(arch)
    ids = random_ids(2, 11)
    expected = logits(base, ids)
    model = create_hierarchical_bem(base, small_config())
    assert sum(isinstance(m, BEMLinear) for m in model.modules()) == 2 * (7 if arch in DECODERS[:3] else 6 if arch == "bert" else 4)
    assert torch.equal(logits(model, ids), expected)


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_training_changes_only_bem_parameters_and_disable_restores_base(arch, load_base):
    base = load_base(arch)
    ids = random_ids(2, 9, seed=1)
    expected = logits(base, ids)
    model = create_hierarchical_bem(base, small_config())
    before = {n: p.detach().clone() for n, p in model.named_parameters()}
    trainable = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    model.train()
    for _ in range(3):
        optimizer.zero_grad()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        for name, param in model.named_parameters():
            is_bem = ".bem_" in name or name.startswith("controller.")
            assert param.requires_grad == is_bem, name
            if not is_bem:
                assert param.grad is None, name
        optimizer.step()
    model.eval()
    changed = {n for n, p in model.named_parameters() if not torch.equal(p, before[n])}
    assert changed, "no parameter changed"
    assert all(".bem_" in n or n.startswith("controller.") for n in changed)
    assert any(n.endswith("bem_U") for n in changed) and any(n.startswith("controller.") for n in changed)
    assert not torch.allclose(logits(model, ids), expected)
    with model.disable_bem():
        assert torch.equal(logits(model, ids), expected)
    assert not torch.allclose(logits(model, ids), expected)


@pytest.mark.parametrize("arch", DECODERS)
def test_causality_future_token_never_changes_the_past(arch, load_base):
    model = create_hierarchical_bem(load_base(arch), small_config(chunk_size=3, max_prefix_tokens=5))
    randomize_bem(model)
    ids = random_ids(1, 14, seed=2)
    reference = logits(model, ids)
    for t in (0, 4, 8, 12):
        changed = ids.clone()
        changed[0, t + 1] = (changed[0, t + 1] + 7) % 90 + 3
        out = logits(model, changed)
        assert torch.allclose(out[:, : t + 1], reference[:, : t + 1], atol=1e-6, rtol=0), t
        assert not torch.allclose(out[:, t + 1 :], reference[:, t + 1 :], atol=1e-6), t


@pytest.mark.parametrize("arch", DECODERS)
@pytest.mark.parametrize("chunk_size", [3, 7, 8, 9])
def test_cached_decoding_matches_the_full_sequence(arch, chunk_size, load_base):
    prompt_length, total = 8, 19
    model = create_hierarchical_bem(load_base(arch), small_config(chunk_size=chunk_size, max_prefix_tokens=10))
    randomize_bem(model, seed=chunk_size)
    ids = random_ids(2, total, seed=3)
    full = logits(model, ids)
    out = model(input_ids=ids[:, :prompt_length], use_cache=True)
    pieces, cache = [out.logits], returned_cache(out)
    for t in range(prompt_length, total):
        out = model(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True)
        pieces.append(out.logits)
        cache = returned_cache(out)
    incremental = torch.cat(pieces, dim=1)
    assert (incremental - full).abs().max().item() < 1e-5


@pytest.mark.parametrize("arch", DECODERS)
def test_greedy_generate_equals_stepwise_argmax_without_cache(arch, load_base):
    model = create_hierarchical_bem(load_base(arch), small_config(chunk_size=4))
    randomize_bem(model, seed=5)
    prompt = random_ids(1, 6, seed=4)
    generated = model.generate(prompt, max_new_tokens=10, do_sample=False, use_cache=True, pad_token_id=0)
    sequence = prompt
    for _ in range(10):
        next_token = logits(model, sequence, use_cache=False)[:, -1].argmax(-1, keepdim=True)
        sequence = torch.cat([sequence, next_token], dim=1)
    assert torch.equal(generated, sequence)


@pytest.mark.parametrize("mode", ["sample", "beam"])
def test_sampling_and_beam_search_with_cache_match_no_cache(mode, load_base):
    model = create_hierarchical_bem(load_base("llama"), small_config(chunk_size=3))
    randomize_bem(model, seed=6)
    prompt = random_ids(2, 5, seed=7)
    kwargs = dict(max_new_tokens=9, pad_token_id=0)
    kwargs.update(dict(do_sample=True, top_k=0) if mode == "sample" else dict(num_beams=3, do_sample=False))
    torch.manual_seed(0)
    cached = model.generate(prompt, use_cache=True, **kwargs)
    torch.manual_seed(0)
    uncached = model.generate(prompt, use_cache=False, **kwargs)
    assert torch.equal(cached, uncached)


def _left_pad(rows: list[torch.Tensor]) -> tuple[torch.Tensor, torch.Tensor]:
    length = max(len(r) for r in rows)
    ids = torch.zeros(len(rows), length, dtype=torch.long)
    mask = torch.zeros(len(rows), length, dtype=torch.long)
    for i, row in enumerate(rows):
        ids[i, length - len(row) :] = row
        mask[i, length - len(row) :] = 1
    return ids, mask


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_left_padded_batch_rows_equal_each_row_alone(arch, load_base):
    model = create_hierarchical_bem(load_base(arch), small_config(chunk_size=3, max_prefix_tokens=4))
    randomize_bem(model, seed=8)
    rows = [random_ids(1, n, seed=n)[0] for n in (11, 5, 8)]
    ids, mask = _left_pad(rows)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    batched = logits(model, ids, attention_mask=mask, position_ids=positions)
    for i, row in enumerate(rows):
        alone = logits(model, row[None], position_ids=torch.arange(len(row))[None])
        assert (batched[i, -len(row) :] - alone[0]).abs().max().item() < 1e-5, i


def test_left_padded_generate_rows_equal_each_row_alone(load_base):
    model = create_hierarchical_bem(load_base("llama"), small_config(chunk_size=3))
    randomize_bem(model, seed=9)
    rows = [random_ids(1, n, seed=10 + n)[0] for n in (7, 4)]
    ids, mask = _left_pad(rows)
    batched = model.generate(ids, attention_mask=mask, max_new_tokens=8, do_sample=False, pad_token_id=0)
    for i, row in enumerate(rows):
        alone = model.generate(row[None], max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert torch.equal(batched[i, ids.shape[1] - len(row) :], alone[0]), i


@pytest.mark.parametrize("arch", ARCHITECTURES)
def test_save_and_load_round_trip(arch, load_base, tmp_path):
    model = create_hierarchical_bem(load_base(arch), small_config())
    randomize_bem(model, seed=11)
    ids = random_ids(2, 10, seed=12)
    expected = logits(model, ids)
    model.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = BEMModel.from_pretrained(load_base(arch), tmp_path)
    assert torch.equal(logits(loaded, ids), expected)
    assert not any(p.requires_grad for p in loaded.parameters())
    trainable = BEMModel.from_pretrained(load_base(arch), tmp_path, is_trainable=True)
    assert {n for n, p in trainable.named_parameters() if p.requires_grad} == {
        n for n, p in model.named_parameters() if p.requires_grad}


def test_loading_onto_a_different_base_names_the_module(load_base, tmp_path):
    from transformers import LlamaConfig, LlamaForCausalLM

    model = create_hierarchical_bem(load_base("llama"), small_config())
    model.save_pretrained(tmp_path)
    wider = LlamaForCausalLM(LlamaConfig(vocab_size=97, hidden_size=48, intermediate_size=64, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2))
    with pytest.raises(ValueError, match=r"module 'model\.layers\.0\.[a-z_.]+' is \d+ -> 48 in this base model but .* trained for \d+ -> 32"):
        BEMModel.from_pretrained(wider, tmp_path)
    with pytest.raises(ValueError, match="does not have"):
        BEMModel.from_pretrained(load_base("gpt2"), tmp_path)


def test_gradient_checkpointing_gives_the_same_gradients(load_base):
    grads = []
    for checkpointing in (False, True):
        model = create_hierarchical_bem(load_base("llama"), small_config())
        randomize_bem(model, seed=13)
        if checkpointing:
            model.gradient_checkpointing_enable()
        model.train()
        ids = random_ids(2, 10, seed=14)
        model(input_ids=ids, labels=ids).loss.backward()
        grads.append({n: p.grad.clone() for n, p in model.named_parameters() if p.requires_grad})
    assert grads[0].keys() == grads[1].keys()
    for name in grads[0]:
        assert torch.allclose(grads[0][name], grads[1][name], atol=1e-6), name
    assert any(g.abs().sum() > 0 for n, g in grads[1].items() if n.startswith("controller."))
    with pytest.raises(ValueError, match="non-reentrant"):
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": True})


def test_routing_stats_and_trainable_parameter_report(load_base, capsys):
    model = create_hierarchical_bem(load_base("llama"), small_config())
    with pytest.raises(RuntimeError, match="forward pass"):
        model.routing_stats()
    model(input_ids=random_ids(1, 9))
    stats = model.routing_stats()
    assert stats["routing"] is True and stats["levels_recorded"]
    assert set(stats["modules"]) == set(model.bem_module_names)
    assert 0.9 < stats["gate_mean"] < 1.0  # gate starts close to one
    up = stats["modules"]["model.layers.0.mlp.up_proj"]
    assert up["token_routed"] and not stats["modules"]["model.layers.0.self_attn.o_proj"]["token_routed"]
    assert up["prefix_norm"] == 0.0 and up["chunk_norm"] == 0.0  # heads start at zero
    model.print_trainable_parameters()
    assert "trainable params:" in capsys.readouterr().out
    model.train()
    model(input_ids=random_ids(1, 9), labels=random_ids(1, 9)).loss.backward()  # a training pass
    stats = model.routing_stats()
    assert not stats["levels_recorded"] and stats["modules"]["model.layers.0.mlp.up_proj"]["prefix_norm"] is None
    assert stats["code_norm_mean"] > 0 and 0.9 < stats["gate_mean"] < 1.0


def test_side_signals_reach_the_chunk_level(load_base):
    model = create_hierarchical_bem(load_base("llama"), small_config(side_signal_dim=3))
    randomize_bem(model, seed=15)
    ids = random_ids(2, 9)
    a = logits(model, ids, side_signals=torch.zeros(2, 3))
    b = logits(model, ids, side_signals=torch.ones(2, 3))
    assert not torch.allclose(a, b)
    with pytest.raises(ValueError, match="side_signals"):
        logits(model, ids)
    generated = model.generate(ids[:1], side_signals=torch.ones(1, 3), max_new_tokens=3, do_sample=False,
                               pad_token_id=0)
    assert generated.shape == (1, 12)


def test_calling_the_backbone_directly_routes_its_own_tokens(load_base):
    model = create_hierarchical_bem(load_base("llama"), small_config())
    randomize_bem(model, seed=16)
    ids = random_ids(1, 9, seed=17)
    via_head = model(input_ids=ids, output_hidden_states=True).hidden_states[-1]
    model(input_ids=random_ids(1, 9, seed=18))  # leave other codes of the same shape behind
    direct = model.base_model.model(input_ids=ids).last_hidden_state
    assert torch.allclose(direct, via_head, atol=1e-6)


def test_autocast_and_fp32_adapters_on_a_bf16_base_match_the_upcast_reference(load_base):
    base = load_base("llama").to(torch.bfloat16)
    model = create_hierarchical_bem(base, small_config())
    randomize_bem(model, seed=19)
    for name, param in model.named_parameters():
        if param.requires_grad:
            param.data = param.data.float()  # fp32 master weights, as mixed-precision training keeps them
    ids = random_ids(2, 8, seed=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        out = model(input_ids=ids, labels=ids)
    out.loss.backward()
    assert out.logits.dtype in (torch.bfloat16, torch.float32) and torch.isfinite(out.logits).all()
    grads = [p.grad for p in model.parameters() if p.requires_grad]
    assert all(g is not None and g.dtype == torch.float32 and torch.isfinite(g).all() for g in grads)
    with torch.no_grad():
        plain = model(input_ids=ids).logits  # no autocast: adapters in fp32, base in bf16
    assert (out.logits.float() - plain.float()).abs().max() < 0.15 * plain.float().abs().max()


def test_codes_are_made_in_the_autocast_dtype(load_base, monkeypatch):
    """Under autocast the wrapped linears compute in its dtype: the controller (float32 here) makes the codes in
    it, so that no linear casts them again and keeps its cast for the backward; without autocast, the block's."""
    base = load_base("llama").to(torch.bfloat16)
    model = create_hierarchical_bem(base, small_config())
    for param in model.parameters():
        if param.requires_grad:
            param.data = param.data.float()
    seen = []
    real = BEMLinear._forward_autocast
    monkeypatch.setattr(BEMLinear, "_forward_autocast", lambda self, x, codes: seen.append(codes.dtype) or real(self, x, codes))
    ids = random_ids(2, 8, seed=20)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(input_ids=ids, labels=ids).loss.backward()
    assert seen and set(seen) == {torch.bfloat16}
    assert model._hooks.last_levels["codes"].dtype == torch.bfloat16
    model(input_ids=ids)
    assert model._hooks.last_levels["codes"].dtype == torch.float32  # the first block's first parameter: V


@pytest.mark.parametrize("options", [
    dict(num_beams=3, num_return_sequences=2, do_sample=False),
    dict(do_sample=True, num_return_sequences=3),
    "generation_config",
], ids=["beams", "samples", "generation_config"])
def test_side_signals_follow_generate_expanding_the_batch(options, load_base):
    """generate repeats each row for beams or samples (by max(num_beams, num_return_sequences), or as a passed
    GenerationConfig says): each copy gets its row's side signal, so a row generates what it generates alone."""
    from transformers import GenerationConfig

    model = create_hierarchical_bem(load_base("llama"), small_config(side_signal_dim=3))
    randomize_bem(model, seed=19)
    ids = random_ids(2, 6, seed=20)
    signals = torch.randn(2, 3, generator=torch.Generator().manual_seed(21))
    if options == "generation_config":
        kwargs = dict(generation_config=GenerationConfig(num_beams=2, num_return_sequences=2, max_new_tokens=4,
                                                         pad_token_id=0))
    else:
        kwargs = dict(options, max_new_tokens=4, pad_token_id=0)
    torch.manual_seed(0)
    both = model.generate(ids, side_signals=signals, **kwargs)
    copies = both.shape[0] // 2
    for row in range(2):
        torch.manual_seed(0)
        alone = model.generate(ids[row:row + 1], side_signals=signals[row:row + 1], **kwargs)
        assert alone.shape[0] == copies
        if not (isinstance(options, dict) and options.get("do_sample")):  # sampling: one random stream per batch
            assert torch.equal(both[row * copies:(row + 1) * copies], alone), row
