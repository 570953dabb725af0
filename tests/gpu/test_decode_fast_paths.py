"""Decode-time fast paths agree with the plain paths: the controller's CUDA-graph step, and the direct
(no-autograd) call of the fused linear."""

from __future__ import annotations

import pytest
import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.kernels import KERNELS_AVAILABLE
from bem.modules.controller import HierarchicalController

pytestmark = pytest.mark.gpu


def _controller(seed: int) -> HierarchicalController:
    torch.manual_seed(seed)
    controller = HierarchicalController(hidden_size=48, num_modules=5, rank=8, token_module_indices=[1, 3],
                                        controller_dim=16, chunk_size=3, max_prefix_tokens=4).cuda().eval()
    with torch.no_grad():
        for name, param in controller.named_parameters():
            if param.dim() >= 1 and name != "static_codes":
                param.normal_(std=0.5)
    return controller


@pytest.mark.parametrize("batch", [1, 3])
def test_graph_replayed_step_equals_the_eager_step_and_the_full_sequence(batch):
    controller = _controller(batch)
    hidden = torch.randn(batch, 11, 48, device="cuda")
    mask = torch.ones(batch, 11, device="cuda")
    if batch > 1:
        mask[1, :3] = 0
    with torch.no_grad():
        full = controller(hidden, mask).codes
        results = {}
        for graphs in (True, False):
            controller.step_graphs.enabled = graphs
            out = controller(hidden[:, :4], mask[:, :4], return_state=True)
            pieces, state = [out.codes], out.state
            for t in range(4, 11):
                step = controller.step(hidden[:, t : t + 1], state, mask[:, t : t + 1])
                pieces.append(step.codes.clone())
                state = step.state
            results[graphs] = torch.cat(pieces, dim=2)
    assert len(controller.step_graphs._captured) == 1
    real = mask.bool()
    assert torch.allclose(results[True], results[False], atol=1e-6)
    assert torch.allclose(results[True][:, real], full[:, real], atol=1e-5)


def test_two_caches_never_share_state_buffers():
    controller = _controller(7)
    hidden = torch.randn(1, 3, 48, device="cuda")
    with torch.no_grad():
        state = controller(hidden[:, :2], return_state=True).state  # inside the prefix window (P = 4)
        a = controller.step(hidden[:, 2:3], state).state
        b = controller.step(hidden[:, 2:3] * 2, state).state  # a second branch from the same state
        a_again = controller.step(hidden[:, 2:3], state).state
    assert not torch.equal(a.prefix_sum, b.prefix_sum)
    assert torch.equal(a.prefix_sum, a_again.prefix_sum)
    assert a.prefix_sum.data_ptr() != b.prefix_sum.data_ptr()


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_cached_generation_with_every_fast_path_matches_the_full_forward(dtype):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
    model = create_hierarchical_bem(LlamaForCausalLM(config).to("cuda", dtype).eval(),
                                    HierarchicalBEMConfig(rank=8, chunk_size=4, attach_qkv=True))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if param.requires_grad and name.endswith("bem_U"):
                param.normal_(std=0.05)
        ids = torch.randint(3, 101, (2, 14), device="cuda")
        full = model(input_ids=ids).logits.float()
        out = model(input_ids=ids[:, :9], use_cache=True)
        pieces, cache = [out.logits.float()], out.past_key_values
        for t in range(9, 14):
            out = model(input_ids=ids[:, t : t + 1], past_key_values=cache, use_cache=True)
            pieces.append(out.logits.float())
            cache = out.past_key_values
    tolerance = 5e-2 if dtype == torch.bfloat16 else 1e-4
    error = (torch.cat(pieces, dim=1) - full).norm() / full.norm()
    assert error < tolerance


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
@pytest.mark.parametrize("M,K,N,mode,split_k", [
    (1, 2048, 2048, 1, 0), (1, 512, 768, 1, 4), (5, 1000, 333, 1, 2), (16, 256, 512, 1, 1),  # streaming kernel
    (1, 2048, 2048, 5, 0), (5, 1000, 333, 5, 3), (16, 256, 512, 5, 1),                      # tiles kernel
])
def test_inference_linear_without_p_gives_the_same_output(M, K, N, mode, split_k):
    from bem.kernels import custom_ops, ops, reference

    g = torch.Generator(device="cuda").manual_seed(M * 7 + K)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    x, W, b, V, c, U = make(M, K), make(N, K) / K**0.5, make(N), make(K, 8) / K**0.5, make(M, 8), make(N, 8)
    with_p, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 0.5, mode, split_k, need_p=True)
    without_p, none = custom_ops._C.linear_forward(x, W, b, V, c, U, 0.5, mode, split_k, need_p=False)
    assert none is None and P is not None
    assert torch.equal(with_p, without_p)
    with torch.no_grad():
        direct = ops.bem_linear(x, W, b, V, c, U, 0.5)  # the no-autograd path
    ref = reference.bem_linear(*(t.double() for t in (x, W, b, V, c, U)), 0.5)
    assert torch.isfinite(direct).all()
    assert (direct.double() - ref).norm() / ref.norm() < 1e-2


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
def test_default_dispatch_sends_prefill_sized_training_calls_to_the_reference(monkeypatch):
    from bem.kernels import ops

    monkeypatch.setattr(ops, "TRAINING_USES_REFERENCE", True)
    x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
    V = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
    assert "reference path measured faster" in ops.fused_unavailable_reason(x, V)
    with torch.no_grad():
        assert ops.fused_unavailable_reason(x, V) is None
    assert ops.fused_unavailable_reason(x[:16], V) is None  # decode sizes keep the fused kernel


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
def test_cuda_graph_captured_decode_with_a_static_cache_matches_the_full_forward():
    from transformers import LlamaConfig, LlamaForCausalLM, StaticCache

    torch.manual_seed(1)
    config = LlamaConfig(vocab_size=101, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
    # sdpa: transformers' eager-attention mask builder copies a host scalar, which a capture forbids
    base = LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()
    base.config._attn_implementation = "sdpa"
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, chunk_size=3, max_prefix_tokens=5))
    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("bem_U") or (name.startswith("controller.") and param.dim() == 2):
                param.normal_(std=0.05)
        ids = torch.randint(3, 101, (1, 16), device="cuda")
        full = model(input_ids=ids).logits.float()
        cache = StaticCache(config=config, max_cache_len=32)
        model(input_ids=ids[:, :8], past_key_values=cache, use_cache=True,
              cache_position=torch.arange(8, device="cuda"))
        step_ids = ids[:, 8:9].clone()
        position = torch.tensor([8], device="cuda")
        eager = model(input_ids=step_ids, past_key_values=cache, use_cache=True, cache_position=position)
        pieces = [eager.logits.float()]  # an eager step first also warms everything up before capture
        graph = torch.cuda.CUDAGraph()
        step_ids.copy_(ids[:, 9:10])
        position.fill_(9)
        with torch.cuda.graph(graph):
            captured = model(input_ids=step_ids, past_key_values=cache, use_cache=True, cache_position=position)
        for t in range(9, 16):
            step_ids.copy_(ids[:, t : t + 1])
            position.fill_(t)
            graph.replay()
            pieces.append(captured.logits.float().clone())
    decoded = torch.cat(pieces, dim=1)
    error = (decoded - full[:, 8:16]).norm() / full[:, 8:16].norm()
    assert error < 5e-2, error
    assert torch.isfinite(decoded).all()


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
@pytest.mark.parametrize("lead", [(1, 1), (16, 1), (2, 3, 5), (4, 300)])
def test_linear_forward_takes_leading_dimensions(lead):
    """(..., K) activations and (..., r) codes give exactly the rows' result, shaped (..., N)."""
    from bem.kernels import custom_ops

    g = torch.Generator(device="cuda").manual_seed(sum(lead))
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    K, N, r = 256, 200, 8
    x, c = make(*lead, K), make(*lead, r)
    W, b, V, U = make(N, K) / K**0.5, make(N), make(K, r) / K**0.5, make(N, r)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 0.5)
    y_rows, P_rows = custom_ops._C.linear_forward(x.reshape(-1, K), W, b, V, c.reshape(-1, r), U, 0.5)
    assert y.shape == (*lead, N) and P.shape == (x.numel() // K, r)
    assert torch.equal(y.reshape(-1, N), y_rows) and torch.equal(P, P_rows)


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
def test_linear_forward_refuses_leading_dimensions_it_cannot_take():
    from bem.kernels import custom_ops

    make = lambda *shape: torch.randn(*shape, device="cuda", dtype=torch.bfloat16)  # noqa: E731
    W, V, U = make(16, 32), make(32, 8), make(16, 8)
    with pytest.raises(ValueError, match="leading dimensions of x"):
        custom_ops._C.linear_forward(make(2, 3, 32), W, None, V, make(3, 2, 8), U, 1.0)
    with pytest.raises(ValueError, match="x must be contiguous"):
        custom_ops._C.linear_forward(make(3, 2, 32).transpose(0, 1), W, None, V, None, U, 1.0)
    with pytest.raises(ValueError, match="at least one leading dimension"):
        custom_ops._C.linear_forward(make(32), W, None, V, None, U, 1.0)


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
@pytest.mark.parametrize("case", ["strided weight", "strided V", "one-dimensional x", "strided x"])
def test_inference_call_falls_back_for_what_the_kernels_refuse(case):
    """Without autograd ops.bem_linear calls the extension directly; what it refuses goes through the
    general path (a copy), with the same result as the reference."""
    from bem.kernels import ops, reference

    g = torch.Generator(device="cuda").manual_seed(11)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    K, N, r = 64, 48, 8
    x, c, W, b = make(2, 3, K), make(2, 3, r), make(N, K) / K**0.5, make(N)
    V, U = make(K, r) / K**0.5, make(N, r)
    if case == "strided weight":
        W = make(N, 2 * K)[:, ::2] / K**0.5
    elif case == "strided V":
        V = make(K, 2 * r)[:, ::2] / K**0.5
    elif case == "one-dimensional x":
        x, c = x[0, 0], c[0, 0]
    else:
        x = make(3, 2, K).transpose(0, 1)
    with torch.no_grad():
        out = ops.bem_linear(x, W, b, V, c, U, 0.5)
    ref = reference.bem_linear(*(t.double() for t in (x, W, b, V, c.reshape(*x.shape[:-1], r), U)), 0.5)
    assert out.shape == (*x.shape[:-1], N)
    assert (out.double() - ref).norm() / ref.norm() < 1e-2
