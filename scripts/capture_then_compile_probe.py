"""Which part of a hand-captured decoding step breaks a later compiled `generate` in the same process.

First half: a bf16 Llama's decoding step with a static cache, captured by hand with `torch.cuda.graph` and
replayed (as `tests/gpu/test_decode_fast_paths.py` does); second half: a fresh fp32 Llama's `generate` with
a static cache (its decoding step compiled: inductor, CUDA-graph trees), then a synchronize. One variant per
process: `python scripts/capture_then_compile_probe.py VARIANT`; prints `VARIANT: ok` or the error.

Variants name what each half runs: `bem` or `plain` (no BEM), `eager` (no capture in the first half),
`reference` (BEM without the fused kernels in the first half), `nographs` (BEM_CONTROLLER_GRAPHS=0, set by
the caller)."""

from __future__ import annotations

import inspect
import sys

import torch
from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.call_inputs import CACHE_KEYWORD


def model(dtype: torch.dtype, with_bem: bool, fused: bool = True):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128, pad_token_id=0)
    base = LlamaForCausalLM(config).to("cuda", dtype).eval()
    base.config._attn_implementation = "sdpa"
    if not with_bem:
        return base
    wrapped = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, chunk_size=3, max_prefix_tokens=5,
                                                                  use_fused_kernels=fused))
    with torch.no_grad():
        for name, param in wrapped.named_parameters():
            if name.endswith("bem_U") or (name.startswith("controller.") and param.dim() == 2):
                param.normal_(std=0.05)
    return wrapped


def first_half(net, capture: bool) -> None:
    ids = torch.randint(3, 101, (1, 16), device="cuda")
    forward = getattr(net, "base_model", net).forward
    # transformers before 5.24 takes the write position as cache_position; later ones keep it in the cache
    takes_position = "cache_position" in inspect.signature(forward).parameters
    position = torch.tensor([8], device="cuda")
    at = {"cache_position": position} if takes_position else {}
    with torch.no_grad():
        cache = StaticCache(config=net.config, max_cache_len=32)
        net(input_ids=ids[:, :8], **{CACHE_KEYWORD: cache}, use_cache=True,
            **({"cache_position": torch.arange(8, device="cuda")} if takes_position else {}))
        step_ids = ids[:, 8:9].clone()
        net(input_ids=step_ids, **{CACHE_KEYWORD: cache}, use_cache=True, **at)
        step_ids.copy_(ids[:, 9:10])
        position.fill_(9)
        if capture:
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                out = net(input_ids=step_ids, **{CACHE_KEYWORD: cache}, use_cache=True, **at)
            for t in range(9, 16):
                step_ids.copy_(ids[:, t : t + 1])
                position.fill_(t)
                graph.replay()
            torch.cuda.synchronize()
            del graph, out
        else:
            for t in range(9, 16):
                step_ids.copy_(ids[:, t : t + 1])
                position.fill_(t)
                net(input_ids=step_ids, **{CACHE_KEYWORD: cache}, use_cache=True, **at)
    torch.cuda.synchronize()


def second_half(net) -> None:
    torch._dynamo.reset()
    ids = torch.randint(3, 101, (2, 9), device="cuda")
    out = net.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False, pad_token_id=0,
                       cache_implementation="static")
    torch.cuda.synchronize()
    assert out.shape == (2, 17)


VARIANTS = {
    "bem-then-bem": lambda: (first_half(model(torch.bfloat16, True), True), second_half(model(torch.float32, True))),
    "plain-then-plain": lambda: (first_half(model(torch.bfloat16, False), True),
                                 second_half(model(torch.float32, False))),
    "bem-then-plain": lambda: (first_half(model(torch.bfloat16, True), True), second_half(model(torch.float32, False))),
    "plain-then-bem": lambda: (first_half(model(torch.bfloat16, False), True), second_half(model(torch.float32, True))),
    "eager-bem-then-bem": lambda: (first_half(model(torch.bfloat16, True), False),
                                   second_half(model(torch.float32, True))),
    "reference-then-bem": lambda: (first_half(model(torch.bfloat16, True, fused=False), True),
                                   second_half(model(torch.float32, True))),
    "nographs": lambda: (first_half(model(torch.bfloat16, True), True), second_half(model(torch.float32, True))),
}


if __name__ == "__main__":
    name = sys.argv[1]
    try:
        VARIANTS[name]()
        print(f"{name}: ok")
    except Exception as error:  # noqa: BLE001 - the probe reports whatever failed
        print(f"{name}: {type(error).__name__}: {str(error).splitlines()[0][:160]}")
