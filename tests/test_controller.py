"""The controller alone: causality of every level, step == whole-sequence, padding, clamp, gate."""

from __future__ import annotations

import pytest
import torch

from bem.modules.controller import HierarchicalController


def make_controller(seed=0, **overrides) -> HierarchicalController:
    torch.manual_seed(seed)
    fields = dict(hidden_size=12, num_modules=3, rank=4, token_module_indices=[1], controller_dim=8,
                  chunk_size=3, max_prefix_tokens=5, ema_decay=0.7, code_clamp_value=1.5)
    fields.update(overrides)
    controller = HierarchicalController(**fields)
    with torch.no_grad():
        for name, param in controller.named_parameters():
            if param.dim() >= 1 and name != "static_codes":
                param.normal_(std=0.5)
    return controller.double().eval()


def test_codes_at_init_are_the_gate_times_ones():
    controller = HierarchicalController(hidden_size=12, num_modules=3, rank=4, token_module_indices=[0, 2])
    out = controller(torch.randn(2, 9, 12))
    gate = torch.sigmoid(torch.tensor(4.0))
    assert out.codes.shape == (3, 2, 9, 4)
    assert torch.allclose(out.codes, torch.full_like(out.codes, gate.item()))


def test_every_level_is_causal():
    controller = make_controller()
    hidden = torch.randn(2, 17, 12, dtype=torch.float64)
    reference = controller(hidden).codes
    for t in range(16):
        changed = hidden.clone()
        changed[:, t + 1 :] = torch.randn_like(changed[:, t + 1 :])
        codes = controller(changed).codes
        assert torch.equal(codes[:, :, : t + 1], reference[:, :, : t + 1]), t
        assert not torch.allclose(codes[:, :, t + 1 :], reference[:, :, t + 1 :]), t


@pytest.mark.parametrize("split", [1, 2, 3, 5, 6, 11])
def test_incremental_steps_equal_the_whole_sequence(split):
    controller = make_controller(seed=split)
    hidden = torch.randn(2, 14, 12, dtype=torch.float64)
    mask = torch.ones(2, 14)
    mask[1, :4] = 0  # second row is left-padded
    full = controller(hidden, mask).codes
    first = controller(hidden[:, :split], mask[:, :split], return_state=True)
    pieces, state = [first.codes], first.state
    for t in range(split, 14):
        out = controller.step(hidden[:, t : t + 1], state, mask[:, t : t + 1])
        pieces.append(out.codes)
        state = out.state
    incremental = torch.cat(pieces, dim=2)
    real = mask.bool()
    assert torch.allclose(incremental[:, real], full[:, real], atol=1e-12)


def test_padding_never_shifts_prefix_or_chunk_boundaries():
    controller = make_controller(seed=3)
    hidden = torch.randn(1, 10, 12, dtype=torch.float64)
    alone = controller(hidden).codes
    padded_hidden = torch.cat([torch.randn(1, 4, 12, dtype=torch.float64), hidden], dim=1)
    mask = torch.cat([torch.zeros(1, 4), torch.ones(1, 10)], dim=1)
    padded = controller(padded_hidden, mask).codes
    assert torch.allclose(padded[:, :, 4:], alone, atol=1e-12)


def test_rows_are_independent_no_state_crosses_the_batch():
    controller = make_controller(seed=4)
    hidden = torch.randn(3, 11, 12, dtype=torch.float64)
    together = controller(hidden).codes
    for row in range(3):
        assert torch.allclose(controller(hidden[row : row + 1]).codes[:, 0], together[:, row], atol=1e-12)


def test_prefix_level_is_constant_after_the_prefix_window():
    controller = make_controller(seed=5, enable_token_routing=False, enable_uncertainty=False,
                                 chunk_size=100, code_clamp_value=1e9)
    hidden = torch.randn(1, 12, 12, dtype=torch.float64)
    codes = controller(hidden).codes
    # with one chunk (EMA = 0) and no token level, codes depend only on p_t, fixed for t >= P = 5
    assert torch.allclose(codes[:, :, 5:], codes[:, :, 5:6].expand_as(codes[:, :, 5:]))
    assert not torch.allclose(codes[:, :, 3], codes[:, :, 4])


def test_clamp_bounds_the_dynamic_part():
    controller = make_controller(seed=6, enable_uncertainty=False, code_clamp_value=0.25)
    with torch.no_grad():
        controller.prefix_head[-1].weight.mul_(50)
    out = controller(torch.randn(2, 9, 12, dtype=torch.float64))
    norms = torch.linalg.vector_norm(out.levels["dynamic"], dim=-1)
    assert norms.max() <= 0.25 + 1e-9 and norms.max() > 0.2
    static = controller.static_codes.detach()
    assert torch.allclose(out.codes.permute(1, 2, 0, 3), static + out.levels["dynamic"])


def test_gradients_are_finite_at_init_where_the_dynamic_part_is_zero():
    controller = HierarchicalController(hidden_size=12, num_modules=2, rank=4, token_module_indices=[0])
    out = controller(torch.randn(2, 7, 12))
    (out.codes * torch.randn_like(out.codes)).sum().backward()
    for name, param in controller.named_parameters():
        assert param.grad is not None and torch.isfinite(param.grad).all(), name
    assert controller.prefix_head[-1].weight.grad.abs().sum() > 0  # zero-init heads still learn


def test_uncertainty_gate_has_a_learnable_temperature():
    controller = make_controller(seed=7)
    hidden = torch.randn(1, 6, 12, dtype=torch.float64)
    before = controller(hidden).levels["gate"]
    with torch.no_grad():
        controller.gate_log_temperature.fill_(2.0)
    after = controller(hidden).levels["gate"]
    assert ((before - 0.5).abs() > (after - 0.5).abs()).all()  # hotter gate: closer to one half
    assert make_controller(enable_uncertainty=False)(hidden).levels["gate"] is None


@pytest.mark.parametrize("gate", [True, False])
def test_training_recomputes_the_second_layer_and_clamp_with_the_same_gradients(gate, monkeypatch):
    """Under autograd the heads' two layers, the gate, the clamp and the input's normalisation are recomputed in
    the backward: the codes and every gradient equal those of the same math kept by autograd (the checkpoints
    replaced by plain calls), and no tensor of tokens x modules x rank values, of the first layer's width, nor of
    tokens x hidden size, is kept for the backward."""
    from bem.modules import controller as controller_module

    def run():
        controller = make_controller(seed=9, rank=5, enable_uncertainty=gate, code_clamp_value=0.8).train()
        hidden = torch.randn(2, 7, 12, dtype=torch.float64, requires_grad=True)
        kept = []
        # what is kept: its size, and whether it is the input itself (which the model keeps anyway)
        with torch.autograd.graph.saved_tensors_hooks(
                lambda t: kept.append((t.numel(), t.data_ptr() == hidden.data_ptr())) or t, lambda t: t):
            codes = controller(hidden).codes
        (codes * torch.linspace(-1, 2, codes.numel(), dtype=codes.dtype).view_as(codes)).sum().backward()
        grads = [hidden.grad] + [param.grad for param in controller.parameters()]
        return codes.detach(), grads, kept

    codes, grads, kept = run()
    full_size = 2 * 7 * 3 * 5  # B x T x modules x rank (no other tensor of the call has that many values)
    hidden_size = 2 * 7 * 12  # B x T x hidden
    first_sizes = {2 * 7 * 3 * 8, 2 * 7 * (3 * 8 + 1)}  # the heads' first layer: its input, its output
    assert all(size != full_size for size, _ in kept)
    assert all(size not in first_sizes for size, _ in kept)
    assert all(is_input for size, is_input in kept if size == hidden_size)  # the input, not its normalisation
    monkeypatch.setattr(controller_module, "checkpoint", lambda fn, *args, **kwargs: fn(*args))
    plain_codes, plain_grads, plain_kept = run()
    assert any(size == full_size for size, _ in plain_kept)  # without the recompute: the pre-clamp codes
    assert any(size in first_sizes for size, _ in plain_kept)  # the first layer's input and output
    assert any(size == hidden_size and not is_input for size, is_input in plain_kept)  # and the normalised input
    assert torch.equal(codes, plain_codes)
    for grad, plain in zip(grads, plain_grads):
        assert (grad is None) == (plain is None)
        if grad is not None:
            torch.testing.assert_close(grad, plain, rtol=1e-12, atol=1e-12)


def test_training_passes_keep_no_statistics_tensors():
    controller = make_controller(seed=8).train()
    hidden = torch.randn(1, 6, 12, dtype=torch.float64)
    levels = controller(hidden).levels
    assert levels["prefix"] is None and levels["dynamic"] is None  # they would only hold memory in training
    assert levels["codes"] is not None and levels["gate"] is not None
    with torch.no_grad():
        assert controller(hidden).levels["prefix"] is not None


def test_graphs_of_a_controller_destroyed_inside_a_capture_are_kept_until_after_it(monkeypatch):
    """A controller and its graphs form a cycle, so the garbage collector may destroy them inside another
    CUDA-graph capture; their captured calls must then outlive that capture (with CUDA: tests/gpu)."""
    import gc
    import weakref

    from bem.modules import controller_graphs

    class Captured:  # stands for a captured call (a CUDA graph and its buffers)
        pass

    capturing = [True]
    monkeypatch.setattr(controller_graphs, "_capturing", lambda: capturing[0])
    monkeypatch.setattr(controller_graphs, "_DEFERRED", [])
    for inside_a_capture in (True, False):
        capturing[0] = inside_a_capture
        controller = HierarchicalController(hidden_size=16, num_modules=2, rank=4, token_module_indices=[1],
                                            controller_dim=8, chunk_size=2, max_prefix_tokens=2)
        step, forward = Captured(), Captured()
        controller.graphs._steps["key"], controller.graphs._forwards["key"] = step, forward
        captured = {id(step), id(forward)}
        del step, forward
        gone = weakref.ref(controller)
        del controller
        gc.collect()
        assert gone() is None
        kept = {id(call) for call in controller_graphs._DEFERRED}
        assert kept == (captured if inside_a_capture else set())
        controller_graphs._release_deferred()  # the next call: inside the capture it keeps them, after it not
        assert len(controller_graphs._DEFERRED) == (2 if inside_a_capture else 0)
        capturing[0] = False
        controller_graphs._release_deferred()
        assert controller_graphs._DEFERRED == []


def _codes_head_by_head(controller, z, p, chunk_ctx):
    """The codes from each head on its own (prefix + chunk, plus token on its modules), the clamp and the gate."""
    B, T, _ = z.shape
    M, r = controller.num_modules, controller.rank
    dynamic = controller.prefix_head(p).view(B, T, M, r) + controller.chunk_head(chunk_ctx).view(B, T, M, r)
    zp = torch.cat([z, p], dim=-1)
    if controller.token_head is not None:
        dynamic = dynamic.index_add(2, controller.token_module_indices, controller.token_head(zp).view(B, T, -1, r))
    norm = torch.linalg.vector_norm(dynamic, dim=-1, keepdim=True)
    clamped = dynamic * torch.clamp(controller.code_clamp_value / norm, max=1.0)
    gate = torch.ones(B, T, 1, dtype=z.dtype)
    if controller.gate is not None:
        gate = torch.sigmoid(controller.gate(zp) / controller.gate_log_temperature.exp())
    return (gate.unsqueeze(-1) * (controller.static_codes + clamped)).permute(2, 0, 1, 3)


@pytest.mark.parametrize("overrides", [{}, {"enable_uncertainty": False}, {"enable_token_routing": False},
                                       {"token_module_indices": [0, 1, 2]}])
@pytest.mark.parametrize("grad", [False, True])
def test_stacked_heads_equal_the_heads_one_by_one(overrides, grad):
    controller = make_controller(seed=9, **overrides)
    with torch.no_grad():
        controller.gate_log_temperature.fill_(0.3) if controller.gate is not None else None
    z, p, ctx = (torch.randn(2, 7, 8, dtype=torch.float64) for _ in range(3))
    with torch.set_grad_enabled(grad):
        codes, levels = controller._codes(z, p, ctx, torch.float64)
        expected = _codes_head_by_head(controller, z, p, ctx)
    assert torch.allclose(codes, expected, atol=1e-12)
    # the levels of an inference call, computed when read, are each head's own
    assert torch.allclose(levels["prefix"], controller.prefix_head(p).view(2, 7, 3, 4), atol=1e-12)
    assert torch.allclose(levels["chunk"], controller.chunk_head(ctx).view(2, 7, 3, 4), atol=1e-12)
    assert (levels["token"] is None) == (controller.token_head is None)
    assert torch.allclose(levels["codes"], expected.permute(1, 2, 0, 3), atol=1e-12)
    assert set(levels) == {"prefix", "chunk", "dynamic", "token", "gate", "codes"}


def test_levels_read_after_an_autocast_call_are_those_of_the_call():
    """routing_stats() reads the levels after the call, outside its autocast (an evaluation under bf16 mixed
    precision, float32 heads): they are recomputed under the call's autocast, not from bf16 inputs against
    float32 weights."""
    controller = make_controller(seed=11).float()
    hidden = torch.randn(2, 7, 12)
    with torch.no_grad(), torch.autocast("cpu", dtype=torch.bfloat16):
        out = controller(hidden)
        inside = {key: out.levels[key] for key in ("prefix", "chunk", "token", "dynamic")}
    for key, value in inside.items():
        after = out.levels[key]
        assert after.dtype == value.dtype == torch.bfloat16, key
        assert torch.equal(after, value), key


def test_kept_stacked_weights_follow_every_change_of_a_head():
    """Inference calls keep the heads' stacked weights between calls; an in-place update of any head's
    parameter, or a replaced parameter, is in the next call."""
    controller = make_controller(seed=10)
    hidden = torch.randn(2, 8, 12, dtype=torch.float64)

    def both():
        with torch.no_grad():
            kept = controller(hidden).codes
        with torch.enable_grad():  # autograd stacks the weights in the call
            made = controller(hidden).codes.detach()
        return kept, made

    kept, made = both()
    assert torch.allclose(kept, made, atol=1e-12)
    modules = [controller.prefix_head[0], controller.prefix_head[2], controller.chunk_head[0],
               controller.chunk_head[2], controller.token_head[0], controller.token_head[2], controller.gate]
    for module in modules:
        for name in ("weight", "bias"):
            with torch.no_grad():
                getattr(module, name).add_(0.1)
            kept_after, made_after = both()
            assert torch.allclose(kept_after, made_after, atol=1e-12), (module, name)
            assert not torch.allclose(kept_after, kept), (module, name)
            kept = kept_after
    controller.chunk_head[2].weight = torch.nn.Parameter(torch.randn_like(controller.chunk_head[2].weight))
    kept_after, made_after = both()
    assert torch.allclose(kept_after, made_after, atol=1e-12) and not torch.allclose(kept_after, kept)
