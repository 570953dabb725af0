"""Every way transformers decodes gives the full forward's tokens and logits: the dynamic cache, the static
cache with and without left padding, generate's automatic compile of the decoding step, a user's own compiled
decode loop; greedy, sampling and beam search. And BEM fails closed on what it cannot follow."""

from __future__ import annotations

import pytest
import torch
from transformers import CompileConfig, DynamicCache, StaticCache

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.call_inputs import CACHE_KEYWORD, returned_cache

from conftest import random_ids, randomize_bem

ARCHS = ["llama", "qwen2", "gpt2", "gpt_neox"]  # qwen2 builds a dict of masks per layer type
NEW_TOKENS = 6


def wrapped(load_base, arch: str, seed: int = 0):
    model = create_hierarchical_bem(load_base(arch), HierarchicalBEMConfig(
        rank=4, alpha=8.0, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True))
    randomize_bem(model, seed=seed)
    return model


def left_padded(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    ids = random_ids(2, 7, seed=seed)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    ids[1, :3] = 0
    return ids, mask


def full_forward_greedy(model, ids, mask, steps: int = NEW_TOKENS):
    """Greedy decoding by running the whole sequence each step, no cache: (tokens, logits per step)."""
    sequence, mask, scores = ids, mask, []
    for _ in range(steps):
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        last = model(input_ids=sequence, attention_mask=mask, position_ids=positions, use_cache=False).logits[:, -1]
        scores.append(last)
        token = last.argmax(-1, keepdim=True)
        sequence, mask = torch.cat([sequence, token], 1), torch.cat([mask, torch.ones_like(token)], 1)
    return sequence, torch.stack(scores, 1)


def generate(model, ids, mask, **kwargs):
    out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                         return_dict_in_generate=True, output_logits=True, **kwargs)
    return out.sequences, torch.stack(out.logits, 1)


@pytest.mark.parametrize("padded", [False, True], ids=["unpadded", "left-padded"])
@pytest.mark.parametrize("arch", ARCHS)
def test_static_cache_generate_equals_the_full_forward(arch, padded, load_base):
    model = wrapped(load_base, arch, seed=1)
    ids, mask = left_padded(seed=2)
    if not padded:
        mask = torch.ones_like(mask)
    expected, expected_logits = full_forward_greedy(model, ids, mask)
    for implementation in ("dynamic", "static"):
        tokens, logits = generate(model, ids, mask, cache_implementation=implementation)
        assert torch.equal(tokens, expected), implementation
        assert (logits - expected_logits).abs().max().item() < 1e-5, implementation


@pytest.mark.parametrize("arch", ARCHS)
def test_generate_auto_compile_of_the_decoding_step(arch, load_base):
    """generate compiles the decoding step of a static cache (on CUDA by default; forced here on the CPU). The
    tracing backend keeps this fast; the inductor test below runs the code generator too."""
    torch._dynamo.reset()
    model = wrapped(load_base, arch, seed=3)
    ids, mask = left_padded(seed=4)
    expected, expected_logits = full_forward_greedy(model, ids, mask)
    config = CompileConfig(backend="aot_eager", fullgraph=True)
    config._compile_all_devices = True
    tokens, logits = generate(model, ids, mask, cache_implementation="static", compile_config=config)
    assert torch.equal(tokens, expected)
    assert (logits - expected_logits).abs().max().item() < 1e-5


def test_generate_auto_compile_with_inductor(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, "llama", seed=5)
    ids, mask = left_padded(seed=6)
    expected, expected_logits = full_forward_greedy(model, ids, mask)
    config = CompileConfig(fullgraph=True)
    config._compile_all_devices = True
    tokens, logits = generate(model, ids, mask, cache_implementation="static", compile_config=config)
    assert torch.equal(tokens, expected)
    assert (logits - expected_logits).abs().max().item() < 1e-5


def test_a_users_compiled_decode_loop_with_a_static_cache(load_base):
    torch._dynamo.reset()
    model = wrapped(load_base, "llama", seed=7)
    ids = random_ids(2, 12, seed=8)
    expected = model(input_ids=ids, use_cache=False).logits
    cache = StaticCache(config=model.config, max_cache_len=16)
    compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
    with torch.no_grad():
        # the prefill eagerly, the decoding steps compiled, as transformers' generate and docs do it
        pieces = [model(input_ids=ids[:, :6], **{CACHE_KEYWORD: cache}, use_cache=True).logits]
        for t in range(6, 12):
            out = compiled(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True)
            pieces.append(out.logits)
    assert (torch.cat(pieces, 1) - expected).abs().max().item() < 1e-5


@pytest.mark.parametrize("mode", ["sample", "beam"])
def test_sampling_and_beams_under_a_static_cache_match_no_cache(mode, load_base):
    model = wrapped(load_base, "qwen2", seed=9)
    ids, mask = left_padded(seed=10)
    kwargs = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, pad_token_id=0)
    kwargs.update(dict(do_sample=True, top_k=0) if mode == "sample" else dict(num_beams=3, do_sample=False))
    torch.manual_seed(0)
    uncached = model.generate(ids, use_cache=False, **kwargs)
    torch.manual_seed(0)
    static = model.generate(ids, cache_implementation="static", **kwargs)
    assert torch.equal(static, uncached)


# ---------------------------------------------------------------------------------------- failing closed
def test_two_different_caches_under_two_names_are_refused(load_base):
    model = wrapped(load_base, "llama")
    ids = random_ids(1, 4)
    with pytest.raises(ValueError, match=r"two different caches, under cache \(DynamicCache\), past_key_values"):
        model.base_model.model(input_ids=ids, cache=DynamicCache(), past_key_values=DynamicCache())


def test_a_cache_bem_does_not_know_is_refused(load_base):
    model = wrapped(load_base, "llama")
    with pytest.raises(ValueError, match=r"does not know a cache of type tuple"):
        model(input_ids=random_ids(1, 4), **{CACHE_KEYWORD: ((torch.zeros(1), torch.zeros(1)),)})


def test_a_larger_mask_without_the_positions_to_read_it_is_refused(load_base):
    model = wrapped(load_base, "llama")
    with pytest.raises(ValueError, match=r"got a dict of attention masks per layer type \(full_attention\)"):
        model(input_ids=random_ids(1, 4), attention_mask={"full_attention": torch.ones(1, 1, 4, 4, dtype=torch.bool)})
    with pytest.raises(ValueError, match="does not know an attention mask of type str"):
        model(input_ids=random_ids(1, 4), attention_mask="causal")


def test_a_4d_mask_with_position_ids_reads_the_left_padding(load_base):
    model = wrapped(load_base, "llama", seed=11)
    ids, mask = left_padded(seed=12)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    expected = model(input_ids=ids, attention_mask=mask, position_ids=positions).logits
    from transformers.masking_utils import create_causal_mask

    embeds = model.get_input_embeddings()(ids)
    kwargs = dict(config=model.config, attention_mask=mask, position_ids=positions,
                  **{CACHE_KEYWORD: None})
    try:
        four_d = create_causal_mask(input_embeds=embeds, **kwargs)
    except TypeError:  # releases before the rename of the embeddings argument
        four_d = create_causal_mask(inputs_embeds=embeds, **kwargs)
    assert isinstance(four_d, torch.Tensor) and four_d.dim() == 4
    out = model(input_ids=ids, attention_mask=four_d, position_ids=positions).logits
    assert (out[1, 3:] - expected[1, 3:]).abs().max().item() < 1e-5
    assert (out[0] - expected[0]).abs().max().item() < 1e-5


def test_a_cache_with_bem_state_cannot_be_cropped_and_a_crop_drops_the_state(load_base):
    model = wrapped(load_base, "llama")
    ids = random_ids(1, 8)
    cache = returned_cache(model(input_ids=ids, use_cache=True))
    assert cache.is_croppable is False
    plain = DynamicCache()
    assert plain.is_croppable is True  # caches without BEM state are as transformers made them
    for crop in (6, -2):  # an absolute length (the older convention) and tokens to remove (the newer one)
        cache = returned_cache(model(input_ids=ids, use_cache=True))
        try:
            cache.crop(crop)
        except ValueError:  # this release takes the other convention
            continue
        with pytest.raises(ValueError, match="carries no BEM state"):
            model(input_ids=ids[:, -1:], **{CACHE_KEYWORD: cache}, use_cache=True)


def test_assisted_decoding_is_refused_cleanly(load_base):
    model = wrapped(load_base, "llama")
    ids = random_ids(1, 8)
    with pytest.raises(ValueError, match="crop|BEM state"):
        model.generate(ids, prompt_lookup_num_tokens=2, max_new_tokens=4, do_sample=False, pad_token_id=0)
