"""Decoding on CUDA through transformers' fast paths gives the full forward's tokens: the static cache with
left padding, generate's automatic compile of the decoding step (inductor, CUDA graphs: mode reduce-overhead)
and a user's own `torch.compile(mode="reduce-overhead")` loop, with the fused kernels on."""

from __future__ import annotations

import gc
import weakref

import pytest
import torch
from transformers import AutoModelForCausalLM, GPT2Config, LlamaConfig, Qwen2Config, StaticCache

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.call_inputs import CACHE_KEYWORD
from bem.kernels import ops

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]

NEW_TOKENS = 8
_DECODER = dict(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
CONFIGS = {
    "llama": lambda: LlamaConfig(**_DECODER),
    "qwen2": lambda: Qwen2Config(**_DECODER),
    "gpt2": lambda: GPT2Config(vocab_size=101, n_embd=128, n_layer=2, n_head=4, n_positions=128, pad_token_id=0),
}


def wrapped(arch: str, dtype: torch.dtype):
    torch.manual_seed(0)
    base = AutoModelForCausalLM.from_config(CONFIGS[arch]()).to("cuda", dtype).eval()
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, chunk_size=4, max_prefix_tokens=6,
                                                                attach_qkv=True))
    generator = torch.Generator(device="cuda").manual_seed(1)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and param.dim() == 2 and not name.endswith("static_codes"):
                param.copy_(torch.randn(param.shape, device="cuda", generator=generator).to(param.dtype) * 0.1)
    return model


def prompts():
    ids = torch.randint(3, 101, (2, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    mask = torch.ones_like(ids)
    mask[1, :4] = 0
    ids[1, :4] = 0
    return ids, mask


def full_forward_logits(model, sequences, mask):
    """Each generated position's logits from one forward over the whole generated sequence, no cache."""
    full_mask = torch.cat([mask, torch.ones_like(sequences[:, mask.shape[1]:])], 1)
    positions = (full_mask.cumsum(-1) - 1).clamp(min=0)
    with torch.no_grad():
        logits = model(input_ids=sequences, attention_mask=full_mask, position_ids=positions, use_cache=False).logits
    return logits[:, mask.shape[1] - 1 : -1].float()


def check_tokens(model, sequences, mask, step_logits, dtype):
    """Each generated token is the argmax of the full forward's logits at its position (a near tie, closer than
    the dtype's rounding of the logits, may go either way), and the logits agree within the dtype's noise."""
    full = full_forward_logits(model, sequences, mask)
    generated = sequences[:, mask.shape[1]:]
    tolerance = 1e-4 if dtype == torch.float32 else 5e-2
    scale = full.abs().amax().item()
    assert (step_logits - full).abs().max().item() <= tolerance * max(1.0, scale)
    chosen = full.gather(-1, generated.unsqueeze(-1)).squeeze(-1)
    best = full.max(-1).values
    assert ((best - chosen) <= 2 * tolerance * max(1.0, scale)).all(), (best - chosen)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("arch", list(CONFIGS))
def test_static_cache_and_compiled_decoding_equal_the_full_forward(arch, dtype):
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    model = wrapped(arch, dtype)
    ids, mask = prompts()
    # the dynamic cache; the static cache eagerly; the static cache as generate runs it on CUDA by default,
    # its decoding step compiled (inductor, CUDA graphs)
    for options in ({}, {"cache_implementation": "static", "disable_compile": True},
                    {"cache_implementation": "static"}):
        out = model.generate(ids, attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                             return_dict_in_generate=True, output_logits=True, **options)
        check_tokens(model, out.sequences, mask, torch.stack(out.logits, 1).float(), dtype)
    assert hasattr(model.base_model, "_compiled_call")  # generate did compile the decoding step


def test_compiled_decoding_reads_adapters_written_between_generates():
    """The compiled step's CUDA graphs read V and U from the adapter pack in place: adapters written after one
    generate (as a training step writes them) are what the next generate's replays compute with."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch._dynamo.reset()
    model = wrapped("llama", torch.float32)
    ids, mask = prompts()
    options = dict(attention_mask=mask, max_new_tokens=NEW_TOKENS, do_sample=False, pad_token_id=0,
                   return_dict_in_generate=True, output_logits=True, cache_implementation="static")
    before = model.generate(ids, **options)
    flat = model._pack.flat
    with torch.no_grad():
        for _, module in model.bem_modules():
            module.bem_U.mul_(-2.0)
    after = model.generate(ids, **options)
    assert model._pack.flat is flat  # refreshed in place: the same address, the same graphs
    assert not torch.equal(torch.stack(before.logits, 1), torch.stack(after.logits, 1))
    check_tokens(model, after.sequences, mask, torch.stack(after.logits, 1).float(), torch.float32)


def test_a_users_reduce_overhead_decode_loop_with_a_static_cache():
    torch._dynamo.reset()
    model = wrapped("llama", torch.float32)
    ids = torch.randint(3, 101, (2, 14), device="cuda")
    with torch.no_grad():
        expected = model(input_ids=ids, use_cache=False).logits
        cache = StaticCache(config=model.config, max_cache_len=32)
        compiled = torch.compile(model, mode="reduce-overhead", fullgraph=True)
        # the prefill eagerly, the decoding steps compiled, as transformers' generate and docs do it
        pieces = [model(input_ids=ids[:, :6], **{CACHE_KEYWORD: cache}, use_cache=True).logits.clone()]
        for t in range(6, 14):
            pieces.append(compiled(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True).logits.clone())
    assert (torch.cat(pieces, 1) - expected).abs().max().item() < 1e-3


def test_a_dropped_models_controller_graphs_may_die_during_another_capture():
    """A controller and its captured CUDA graphs refer to each other, so a dropped model's graphs are destroyed
    whenever Python's cyclic garbage collector runs: possibly while another CUDA graph is being recorded (as
    inductor records the next model's decoding step). That must break neither the capture nor its replays."""
    first = wrapped("llama", torch.bfloat16)
    ids, mask = prompts()
    for _ in range(2):  # the decoding step is captured at once, the prompt's forward the second time it is seen
        first.generate(ids, attention_mask=mask, max_new_tokens=4, do_sample=False, pad_token_id=0)
    graphs = weakref.ref(first.controller.graphs)
    assert first.controller.graphs._steps and first.controller.graphs._forwards
    x = torch.randn(64, 64, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        x @ x  # cuBLAS warmed up outside the capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    gc.collect()
    gc.disable()  # what is dropped below stays until the collection inside the capture
    try:
        del first
        with torch.cuda.graph(graph):
            y = x @ x
            gc.collect()
            z = y + 1
    finally:
        gc.enable()
    assert graphs() is None
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(z, x @ x + 1)
