"""Decode-time fast paths agree with the plain paths: the controller's CUDA-graph step, and the direct
(no-autograd) call of the fused linear."""

from __future__ import annotations

import inspect

import pytest
import torch

from bem import HierarchicalBEMConfig, create_hierarchical_bem
from bem.kernels import KERNELS_AVAILABLE
from bem.modules.controller import HierarchicalController
from bem.call_inputs import CACHE_KEYWORD, returned_cache

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
            controller.graphs.enabled = graphs
            out = controller(hidden[:, :4], mask[:, :4], return_state=True)
            pieces, state = [out.codes], out.state
            for t in range(4, 11):
                step = controller.step(hidden[:, t : t + 1], state, mask[:, t : t + 1])
                pieces.append(step.codes.clone())
                state = step.state
            results[graphs] = torch.cat(pieces, dim=2)
    assert len(controller.graphs._steps) == 1
    real = mask.bool()
    assert torch.allclose(results[True], results[False], atol=1e-6)
    assert torch.allclose(results[True][:, real], full[:, real], atol=1e-5)


@pytest.mark.parametrize("batch,padded,side", [(1, False, False), (3, True, False), (2, True, True)])
def test_graph_replayed_forward_equals_the_eager_forward(batch, padded, side):
    """A whole-sequence call is captured the second time its shape is seen and replayed after that, with
    the eager call's codes, levels and routing state; the state is the caller's own copy."""
    torch.manual_seed(batch)
    controller = HierarchicalController(hidden_size=48, num_modules=5, rank=8, token_module_indices=[1, 3],
                                        controller_dim=16, chunk_size=3, max_prefix_tokens=4,
                                        side_signal_dim=6 if side else None).cuda().eval()
    with torch.no_grad():
        for name, param in controller.named_parameters():
            if param.dim() >= 1 and name != "static_codes":
                param.normal_(std=0.5)
    mask = torch.ones(batch, 13, device="cuda", dtype=torch.long)
    if padded:
        mask[-1, :4] = 0
    inputs = [(torch.randn(batch, 13, 48, device="cuda"), torch.randn(batch, 6, device="cuda") if side else None)
              for _ in range(4)]
    with torch.no_grad():
        controller.graphs.enabled = False
        eager = [controller(h, mask, s, return_state=True) for h, s in inputs]
        controller.graphs.enabled = True
        replayed = []
        for index, ((h, s), e) in enumerate(zip(inputs, eager)):
            replayed.append(controller(h, mask, s, return_state=True))
            assert len(controller.graphs._forwards) == (0 if index == 0 else 1)
            for name, value in e.levels.items():  # the latest call's levels, for routing_stats()
                level = replayed[-1].levels[name]
                assert (value is None and level is None) or torch.allclose(level, value, atol=1e-6), name
    for e, g in zip(eager, replayed):  # codes and state are the caller's own, whatever ran after them
        assert torch.allclose(g.codes, e.codes, atol=1e-6)
        for name in ("count", "prefix_sum", "chunk_ema", "open_sum", "side"):
            ev, gv = getattr(e.state, name), getattr(g.state, name)
            assert (ev is None and gv is None) or torch.allclose(gv, ev, atol=1e-6), name
    # the states came out of the same graph but are separate tensors
    assert replayed[2].state.prefix_sum.data_ptr() != replayed[3].state.prefix_sum.data_ptr()
    assert not torch.equal(replayed[2].state.prefix_sum, replayed[3].state.prefix_sum)


def test_replays_read_head_weights_changed_in_place_since_the_capture():
    """The replays read the heads' stacked weights, which the controller keeps between calls: an optimizer's
    in-place update after the capture (and a module replaced by a new one) reach the next replay."""
    controller = _controller(11)
    hidden = torch.randn(2, 9, 48, device="cuda")
    with torch.no_grad():
        controller(hidden), controller(hidden)  # captured at the second call
        state = controller(hidden[:, :5], return_state=True).state
        controller.step(hidden[:, 5:6], state)  # the step graph
        assert len(controller.graphs._forwards) == 1 and len(controller.graphs._steps) == 1
        for change in ("in place", "replaced"):
            if change == "in place":
                for module in (controller.prefix_head[2], controller.token_head[0], controller.gate):
                    module.weight.add_(0.25)
            else:
                controller.chunk_head[2].weight = torch.nn.Parameter(torch.randn_like(controller.chunk_head[2].weight))
            replayed = controller(hidden).codes
            stepped = controller.step(hidden[:, 5:6], state).codes
            with torch.enable_grad():  # autograd: eager, with the weights stacked in the call
                eager, eager_step = controller(hidden).codes, controller.step(hidden[:, 5:6], state).codes
            assert torch.allclose(replayed, eager, atol=1e-6), change
            assert torch.allclose(stepped, eager_step, atol=1e-6), change


def test_forward_graphs_only_for_repeated_small_calls():
    from bem.modules import controller_graphs

    controller = _controller(3)
    # a smaller limit than the default, the same rule: the default's calls take gigabytes (the EMA's matrix)
    saved_max = controller_graphs.FORWARD_MAX_CODE_VALUES
    controller_graphs.FORWARD_MAX_CODE_VALUES = 2**15
    try:
        _only_repeated_small_calls(controller, controller_graphs)
    finally:
        controller_graphs.FORWARD_MAX_CODE_VALUES = saved_max


def _only_repeated_small_calls(controller, controller_graphs) -> None:
    limit_tokens = controller_graphs.FORWARD_MAX_CODE_VALUES // (controller.num_modules * controller.rank)
    with torch.no_grad():
        for length in (5, 6, 7):  # each seen once
            controller(torch.randn(1, length, 48, device="cuda"))
        assert not controller.graphs._forwards
        big = torch.randn(1, limit_tokens + 1, 48, device="cuda")
        controller(big), controller(big)
        assert not controller.graphs._forwards
        for length in range(8, 8 + controller_graphs.MAX_FORWARD_GRAPHS + 2):
            hidden = torch.randn(1, length, 48, device="cuda")
            controller(hidden), controller(hidden)
        assert len(controller.graphs._forwards) == controller_graphs.MAX_FORWARD_GRAPHS
    # together the kept graphs hold at most the limit's code values: a new capture evicts the oldest
    per_token = controller.num_modules * controller.rank
    saved = controller_graphs.FORWARD_KEPT_CODE_VALUES
    controller_graphs.FORWARD_KEPT_CODE_VALUES = 30 * per_token
    try:
        with torch.no_grad():
            for length in (20, 10, 9):
                hidden = torch.randn(1, length, 48, device="cuda")
                controller(hidden), controller(hidden)
    finally:
        controller_graphs.FORWARD_KEPT_CODE_VALUES = saved
    assert sorted(v // per_token for v in controller.graphs._forward_values.values()) == [9, 10]
    assert len(controller.graphs._forwards) == 2
    with torch.enable_grad():  # autograd: always eager
        hidden = torch.randn(1, 8 + controller_graphs.MAX_FORWARD_GRAPHS + 1, 48, device="cuda")
        out = controller(hidden)
        assert out.codes.requires_grad


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
        pieces, cache = [out.logits.float()], returned_cache(out)
        for t in range(9, 14):
            out = model(input_ids=ids[:, t : t + 1], **{CACHE_KEYWORD: cache}, use_cache=True)
            pieces.append(out.logits.float())
            cache = returned_cache(out)
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
def test_opting_out_sends_prefill_sized_training_calls_to_the_reference(monkeypatch):
    """BEM_FUSED_TRAINING=0 (TRAINING_USES_REFERENCE): autograd at prefill sizes takes the reference path;
    the fused ops by default."""
    from bem.kernels import ops

    x = torch.randn(4096, 64, device="cuda", dtype=torch.bfloat16)
    V = torch.randn(64, 8, device="cuda", dtype=torch.bfloat16)
    monkeypatch.setattr(ops, "TRAINING_USES_REFERENCE", False)
    assert ops.fused_unavailable_reason(x, V) is None
    monkeypatch.setattr(ops, "TRAINING_USES_REFERENCE", True)
    assert "BEM_FUSED_TRAINING=0 asks for the reference path" in ops.fused_unavailable_reason(x, V)
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
        # transformers before 5.24 takes the write position as cache_position; later ones keep it in the cache
        takes_position = "cache_position" in inspect.signature(model.base_model.forward).parameters
        model(input_ids=ids[:, :8], **{CACHE_KEYWORD: cache}, use_cache=True,
              **({"cache_position": torch.arange(8, device="cuda")} if takes_position else {}))
        step_ids = ids[:, 8:9].clone()
        position = torch.tensor([8], device="cuda")
        at = {"cache_position": position} if takes_position else {}
        eager = model(input_ids=step_ids, **{CACHE_KEYWORD: cache}, use_cache=True, **at)
        pieces = [eager.logits.float()]  # an eager step first also warms everything up before capture
        graph = torch.cuda.CUDAGraph()
        step_ids.copy_(ids[:, 9:10])
        position.fill_(9)
        with torch.cuda.graph(graph):
            captured = model(input_ids=step_ids, **{CACHE_KEYWORD: cache}, use_cache=True, **at)
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
@pytest.mark.parametrize("mode", [0, 2, 3, 4, 6])
@pytest.mark.parametrize("M,K,N,r", [(1024, 2048, 512, 8), (300, 256, 1024, 16), (2048, 256, 4096, 8),
                                     (517, 264, 136, 24)])
def test_linear_forward_with_a_given_v_transposed_equals_the_copying_call(mode, M, K, N, r):
    """V_t, V^T kept by the caller, replaces the copy the prefill paths make: bit-identical results."""
    from bem.kernels import custom_ops

    if mode == 6 and not custom_ops._C.fused_gemm_available():
        pytest.skip("the GEMM with the update inside needs an sm_90a build on a compute capability 9.0 GPU")
    if mode == 6 and (K % 8 or N % 8 or r % 8):
        pytest.skip("the GEMM with the update inside takes K, N and the rank multiples of 8")
    g = torch.Generator(device="cuda").manual_seed(M + K + N + r + mode)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    x, c = make(M, K), make(M, r)
    W, b, V, U = make(N, K) / K**0.5, make(N), make(K, r) / K**0.5, make(N, r)
    y, P = custom_ops._C.linear_forward(x, W, b, V, c, U, 0.5, mode)
    y_t, P_t = custom_ops._C.linear_forward(x, W, b, V, c, U, 0.5, mode, V_t=V.t().contiguous())
    assert torch.equal(y, y_t) and torch.equal(P, P_t)
    ref = (x.double() @ W.double().t() + b.double()
           + 0.5 * ((x.double() @ V.double()) * c.double()) @ U.double().t())
    assert (y_t.double() - ref).norm() / ref.norm() < 2e-2


@pytest.mark.skipif(not KERNELS_AVAILABLE, reason="needs the CUDA extension")
@pytest.mark.parametrize("M", [5, 8, 16])
def test_a_transposed_weight_above_four_tokens_captured_or_not_equals_the_reference(M):
    """A Conv1D-layout weight (a transposed view) above the columns kernel's 4 tokens, eagerly and captured into
    a CUDA graph (the tensor-core kernel for that layout, rank 8): both give the float64 reference."""
    from bem.kernels import custom_ops

    K, N, r = 264, 392, 8
    g = torch.Generator(device="cuda").manual_seed(M)
    make = lambda *shape: torch.randn(*shape, device="cuda", generator=g, dtype=torch.bfloat16)  # noqa: E731
    x, c, b, V, U = make(M, K), make(M, r), make(N), make(K, r) / K**0.5, make(N, r)
    W_t = (make(K, N) / K**0.5).t()  # (N, K), stored (K, N)
    ref = (x.double() @ W_t.double().t() + b.double()
           + 0.5 * ((x.double() @ V.double()) * c.double()) @ U.double().t())
    eager = custom_ops._C.linear_forward(x, W_t, b, V, c, U, 0.5)[0]
    out = torch.full_like(eager, float("nan"))
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):  # a warm-up outside the capture, as torch.cuda.graph's callers do
        custom_ops._C.linear_forward(x, W_t, b, V, c, U, 0.5)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(custom_ops._C.linear_forward(x, W_t, b, V, c, U, 0.5)[0])
    graph.replay()
    torch.cuda.synchronize()
    for y in (eager, out):
        assert torch.isfinite(y).all()
        assert (y.double() - ref).norm() / ref.norm() < 2e-2


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
