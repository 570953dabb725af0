"""The kernel dispatch point on the CPU: which path runs, every error message, the fake ops, the build switch."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from bem import kernels
from bem.kernels import ops, reference


def _operands(dtype=torch.float32, lead=(2, 3), K=16, N=8, r=4):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*lead, K, generator=g).to(dtype)
    W = torch.randn(N, K, generator=g).to(dtype)
    b = torch.randn(N, generator=g).to(dtype)
    V = torch.randn(K, r, generator=g).to(dtype)
    U = torch.randn(N, r, generator=g).to(dtype)
    c = torch.randn(*lead, r, generator=g).to(dtype)
    return x, W, b, V, c, U


def test_kernels_available_is_a_bool_and_false_without_cuda():
    assert isinstance(kernels.KERNELS_AVAILABLE, bool)
    if not torch.cuda.is_available():
        assert kernels.KERNELS_AVAILABLE is False


def test_cpu_tensors_take_the_reference_and_say_why():
    x, W, b, V, c, U = _operands()
    reason = ops.fused_unavailable_reason(x, V, use_fused=True)
    assert reason is not None and ("not loaded" in reason or "cpu" in reason)
    assert ops.fused_unavailable_reason(x, V, use_fused=False) == "use_fused is False"
    assert torch.equal(ops.bem_linear(x, W, b, V, c, U, 0.5), reference.bem_linear(x, W, b, V, c, U, 0.5))
    assert torch.equal(ops.generated_update(x, V, None, U, 0.5), reference.generated_update(x, V, None, U, 0.5))


def test_reference_is_the_maths_of_design():
    x, W, b, V, c, U = _operands(torch.float64)
    expected = x @ W.t() + b + 0.5 * ((x @ V) * c) @ U.t()
    assert torch.allclose(ops.bem_linear(x, W, b, V, c, U, 0.5), expected)
    assert torch.allclose(ops.generated_update(x, V, None, U, 2.0), 2.0 * (x @ V) @ U.t())


def test_transposed_weight_view_is_accepted():
    x, W, b, V, c, U = _operands()
    conv_weight = W.t().contiguous()  # how GPT-2 Conv1D stores it: (K, N)
    out = ops.bem_linear(x, conv_weight.t(), b, V, c, U, 1.0)
    assert torch.allclose(out, reference.bem_linear(x, W, b, V, c, U, 1.0))


@pytest.mark.parametrize(
    "change,message",
    [
        (lambda a: {**a, "V": a["V"][None]}, "V and U must be 2-D"),
        (lambda a: {**a, "U": a["U"][:, :3]}, "rank mismatch"),
        (lambda a: {**a, "x": a["x"][..., :15]}, "input has 15 features"),
        (lambda a: {**a, "codes": a["codes"][..., :3]}, "codes must have shape"),
        (lambda a: {**a, "W": a["W"][:, :15]}, "weight must be"),
        (lambda a: {**a, "b": a["b"][:7]}, "bias must be"),
        (lambda a: {**a, "V": a["V"].double()}, "V has dtype torch.float64"),
        (lambda a: {**a, "codes": a["codes"].double()}, "codes has dtype"),
        (lambda a: {**a, "W": a["W"].double()}, "weight has dtype"),
        (lambda a: {**a, "U": a["U"].to("meta")}, "U is on meta"),
    ],
)
def test_bad_arguments_raise_clear_errors(change, message):
    x, W, b, V, c, U = _operands()
    args = change({"x": x, "W": W, "b": b, "V": V, "codes": c, "U": U})
    with pytest.raises(ValueError, match=message):
        ops.bem_linear(args["x"], args["W"], args["b"], args["V"], args["codes"], args["U"], 1.0)


def test_generated_update_checks_too():
    x, _, _, V, c, U = _operands()
    with pytest.raises(ValueError, match="input has 15 features"):
        ops.generated_update(x[..., :15], V, c, U, 1.0)
    with pytest.raises(ValueError, match="U has dtype"):
        ops.generated_update(x, V, c, U.half(), 1.0)


def test_dispatch_reasons_for_cases_the_kernels_do_not_take(monkeypatch):
    monkeypatch.setattr(ops, "_available", True)
    x, W, b, V, c, U = _operands()
    assert "on cpu" in ops.fused_unavailable_reason(x, V)
    meta = lambda t: t.to("meta")  # noqa: E731 - device-only stand-in for a CUDA tensor's dispatch facts
    xm = meta(x)
    assert xm.device.type == "meta" and "meta" in ops.fused_unavailable_reason(xm, meta(V))


class _StubExtension:
    """Stands in for bem._C: records the direct inference calls, answers or refuses them as told."""

    def __init__(self, refuse: bool):
        self.refuse, self.calls, self.v_t = refuse, [], []

    def linear_forward(self, x, weight, bias, V, codes, U, scaling, mode=0, split_k=0, need_p=True, V_t=None):
        assert mode == 0 and split_k == 0  # the dispatch leaves both to the extension
        self.calls.append((x.shape, None if codes is None else codes.shape, need_p))
        self.v_t.append(V_t)
        if self.refuse:
            raise ValueError("bem: an operand the stub does not take")
        return torch.full((*x.shape[:-1], U.shape[0]), 7.0, dtype=x.dtype), None


@pytest.mark.parametrize("refuse", [False, True])
def test_inference_calls_the_extension_with_leading_dims_and_falls_back_when_refused(monkeypatch, refuse):
    """Without autograd the fused linear goes straight to the extension with (..., K) activations as they
    are; a ValueError from it (an operand it does not take) sends the call down the general path."""
    from bem.kernels import custom_ops

    stub = _StubExtension(refuse)
    monkeypatch.setattr(custom_ops, "_C", stub)
    monkeypatch.setattr(ops, "_inference_call", lambda x, V: True)  # CPU tensors stand in for CUDA ones
    x, W, b, V, c, U = _operands()
    with torch.no_grad():
        out = ops.bem_linear(x, W, b, V, c, U, 0.5)
    assert stub.calls == [((2, 3, 16), (2, 3, 4), False)]
    if refuse:  # the general path: on the CPU, the reference
        assert torch.equal(out, reference.bem_linear(x, W, b, V, c, U, 0.5))
    else:
        assert out.shape == (2, 3, 8) and bool((out == 7.0).all())


def test_bem_linear_keeps_v_transposed_for_prefill_inference_calls(monkeypatch):
    """At prefill sizes an inference call hands the extension V^T, copied once and kept until V changes;
    at decode sizes (the decode kernels read V) and with autograd it hands none."""
    from bem.kernels import custom_ops
    from bem.modules.bem_linear import BEMLinear, RoutingContext

    stub = _StubExtension(refuse=False)
    monkeypatch.setattr(custom_ops, "_C", stub)
    monkeypatch.setattr(ops, "_inference_call", lambda x, V: not torch.is_grad_enabled())
    layer = BEMLinear(torch.nn.Linear(16, 8), rank=4, alpha=8.0, dropout=0.0, module_index=0,
                      context=RoutingContext())
    rows = custom_ops.decode_auto_max_tokens() + 1
    prefill, decode = torch.randn(1, rows, 16), torch.randn(1, rows - 1, 16)
    with torch.no_grad():
        layer(prefill)
        layer(prefill)
        first, second = stub.v_t
        assert first is second and first.is_contiguous() and torch.equal(first, layer.bem_V.t())
        layer.bem_V.add_(1.0)  # an in-place change (an optimizer step, load_state_dict)
        layer(prefill)
        assert stub.v_t[-1] is not first and torch.equal(stub.v_t[-1], layer.bem_V.t())
        layer.bem_V = torch.nn.Parameter(torch.randn(16, 4))  # a replaced parameter
        layer(prefill)
        assert torch.equal(stub.v_t[-1], layer.bem_V.t())
        layer(decode)
        assert stub.v_t[-1] is None
    layer(prefill)  # autograd: the general path, no direct call
    assert len(stub.v_t) == 5
    with torch.inference_mode():  # a module made in inference mode: V has no version counter, nothing kept
        made_there = BEMLinear(torch.nn.Linear(16, 8), rank=4, alpha=8.0, dropout=0.0, module_index=0,
                               context=RoutingContext())
        made_there(prefill)
    assert made_there.bem_V.is_inference() and stub.v_t[-1] is None


class _LeadingDimsStub(_StubExtension):
    """Refuses codes whose leading dimensions are not the input's, as the extension does."""

    def linear_forward(self, x, weight, bias, V, codes, U, scaling, mode=0, split_k=0, need_p=True, V_t=None):
        self.calls.append((x.shape, None if codes is None else codes.shape, need_p))
        if codes is not None and codes.shape[:-1] != x.shape[:-1]:
            raise ValueError("codes must be (..., r) with the leading dimensions of x")
        return torch.full((*x.shape[:-1], U.shape[0]), 7.0, dtype=x.dtype), None


def test_wrapped_layer_calls_the_extension_first_and_lays_out_codes_when_refused(monkeypatch):
    """At inference the wrapped layer hands its operands to the extension before any check of its own;
    codes laid out otherwise than the input (the controller's (batch, tokens) against a layer fed
    (batch x tokens) rows) are refused there and reshaped on the checked path, which calls it again."""
    from bem.kernels import custom_ops
    from bem.modules.bem_linear import BEMLinear, RoutingContext

    stub = _LeadingDimsStub(refuse=False)
    monkeypatch.setattr(custom_ops, "_C", stub)
    monkeypatch.setattr(ops, "_inference_call", lambda x, V: not torch.is_grad_enabled())
    context = RoutingContext()
    layer = BEMLinear(torch.nn.Linear(16, 8), rank=4, alpha=8.0, dropout=0.0, module_index=1, context=context)
    context.set_codes(torch.randn(2, 2, 3, 4))
    with torch.no_grad():
        out = layer(torch.randn(2, 3, 16))
        assert stub.calls == [((2, 3, 16), (2, 3, 4), False)] and bool((out == 7.0).all())
        flat = layer(torch.randn(6, 16))
    assert stub.calls[1:] == [((6, 16), (2, 3, 4), False), ((6, 16), (6, 4), False)]
    assert flat.shape == (6, 8) and bool((flat == 7.0).all())
    context.set_codes(torch.randn(2, 2, 3, 4, dtype=torch.float64))  # codes in another dtype: cast first
    with torch.no_grad():
        layer(torch.randn(2, 3, 16))
    assert stub.calls[-1] == ((2, 3, 16), (2, 3, 4), False) and len(stub.calls) == 4
    with torch.no_grad(), pytest.raises(ValueError, match="token positions"):
        layer(torch.randn(5, 16))  # positions that match no layout of the codes: the checked path explains


@pytest.mark.parametrize("bias", [True, False])
def test_bem_linear_reads_a_base_weight_that_is_not_a_parameter(bias):
    """The wrapped layer reads its base's weight and bias from the parameter dict, and by attribute when
    they are something else (a buffer, as some quantization libraries leave them)."""
    from bem.modules.bem_linear import BEMLinear, RoutingContext

    torch.manual_seed(0)
    layer = BEMLinear(torch.nn.Linear(16, 8, bias=bias), rank=4, alpha=8.0, dropout=0.0, module_index=0,
                      context=RoutingContext())
    torch.nn.init.normal_(layer.bem_U)
    x = torch.randn(2, 3, 16)
    expected = layer(x)
    base = layer.base_layer
    weight = base._parameters.pop("weight").detach()
    base.register_buffer("weight", weight)
    if bias:
        b = base._parameters.pop("bias").detach()
        base.register_buffer("bias", b)
    assert "weight" not in base._parameters
    assert torch.equal(layer(x), expected)


def test_no_direct_inference_call_on_the_cpu():
    x, _, _, V, _, _ = _operands(dtype=torch.bfloat16)
    with torch.no_grad():
        assert not ops._inference_call(x, V)


def test_fake_implementations_give_shapes_and_dtypes():
    from bem.kernels import custom_ops  # noqa: F401 - registers the ops

    x = torch.empty(6, 16, device="meta", dtype=torch.bfloat16)
    W = torch.empty(8, 16, device="meta", dtype=torch.bfloat16)
    V = torch.empty(16, 4, device="meta", dtype=torch.bfloat16)
    U = torch.empty(8, 4, device="meta", dtype=torch.bfloat16)
    y, p = torch.ops.bem.fused_bem_linear(x, W, None, V, None, U, 1.0)
    assert y.shape == (6, 8) and y.dtype == torch.bfloat16 and p.shape == (6, 4) and p.dtype == torch.float32
    y, p = torch.ops.bem.fused_generated_update(x, V, None, U, 1.0)
    assert y.shape == (6, 8) and p.dtype == torch.float32
    y = torch.ops.bem.bem_linear_inference(x, W, None, V, None, U, 1.0)
    assert y.shape == (6, 8) and y.dtype == torch.bfloat16
    p = torch.ops.bem.lowrank_project(x.double(), V.double())
    assert p.shape == (6, 4) and p.dtype == torch.float64


def test_running_an_op_without_the_extension_says_so():
    from bem.kernels import custom_ops

    if custom_ops.extension() is not None:
        pytest.skip("the extension is loaded here")
    x, _, _, V, _, U = _operands(lead=(3,))
    with pytest.raises(RuntimeError, match="extension is not loaded"):
        torch.ops.bem.fused_generated_update(x, V, None, U, 1.0)


def test_compile_fullgraph_through_the_dispatch_on_cpu():
    x, W, b, V, c, U = _operands()
    compiled = torch.compile(lambda x, c: ops.bem_linear(x, W, b, V, c, U, 0.5), fullgraph=True, backend="eager")
    assert torch.allclose(compiled(x, c), reference.bem_linear(x, W, b, V, c, U, 0.5))


def test_setup_skips_the_extension_when_told(tmp_path):
    """BEM_BUILD_CUDA=0 gives a pure-Python package description (no ext_modules)."""
    code = (
        "import os, runpy, setuptools\n"
        "seen = {}\n"
        "setuptools.setup = lambda **kw: seen.update(kw)\n"
        "os.environ['BEM_BUILD_CUDA'] = '0'\n"
        "runpy.run_path('setup.py')\n"
        "assert 'ext_modules' not in seen, seen.keys()\n"
        "assert seen['name'] == 'bem'\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, cwd=str(__import__("pathlib").Path(__file__).parents[1]))


def test_setup_and_the_jit_build_compile_every_kernel_source():
    """setup.py and the just-in-time build take the same sources: every .cpp and .cu file under csrc/, each
    family's from its own folder, and nothing else lies loose in csrc/."""
    from pathlib import Path

    from bem.kernels import loader

    csrc = Path(loader.__file__).parent / "csrc"
    on_disk = sorted(str(p.relative_to(csrc)) for p in csrc.rglob("*") if p.suffix in (".cpp", ".cu"))
    assert sorted(loader.SOURCES) == on_disk
    assert {"lowrank/gemm_update.cu", "lowrank/bindings.cpp", "fftconv/fftconv_bindings.cpp",
            "mlstm/mlstm_bindings.cpp", "module.cpp"} <= set(on_disk)
    assert sorted(p.name for p in csrc.iterdir() if p.is_file()) == ["module.cpp"]
    assert sorted(p.name for p in csrc.iterdir() if p.is_dir()) == sorted(loader.FAMILIES)
    code = (
        "import runpy, setuptools\n"
        "setuptools.setup = lambda **kw: None\n"
        "names = runpy.run_path('setup.py')['kernel_sources']()\n"
        "print(','.join(sorted(n.split('csrc/', 1)[1] for n in names)))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], check=True, capture_output=True, text=True,
                         cwd=str(Path(__file__).parents[1]), env={**__import__("os").environ, "BEM_BUILD_CUDA": "0"})
    assert out.stdout.strip().split(",") == on_disk


@pytest.mark.parametrize("set_list,capability,expected", [
    (None, (9, 0), "9.0a"), (None, (8, 6), "8.6"), ("8.0;9.0", (9, 0), None),
])
def test_jit_arch_list(monkeypatch, set_list, capability, expected):
    """Unset TORCH_CUDA_ARCH_LIST: the GPU's own architecture, 9.0a on Hopper (the fused prefill GEMM
    needs the arch-specific target); set: left to the user."""
    from bem.kernels import loader

    if set_list is None:
        monkeypatch.delenv("TORCH_CUDA_ARCH_LIST", raising=False)
    else:
        monkeypatch.setenv("TORCH_CUDA_ARCH_LIST", set_list)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda *a: capability)
    assert loader._jit_arch_list() == expected


@pytest.mark.parametrize("with_codes", [True, False])
def test_backward_coefficients_outside_half_precision_are_plain_torch(with_codes):
    """float32/float64 take the PyTorch formulas (the kernel is fp16/bf16 only); the fake op's shapes agree."""
    from bem.kernels import custom_ops

    g = torch.Generator().manual_seed(1)
    G, P = torch.randn(5, 3, generator=g), torch.randn(5, 3, generator=g)
    codes = torch.randn(5, 3, generator=g) if with_codes else None
    c = torch.ones(5, 3) if codes is None else codes
    g_c, p_c, g_p = custom_ops.backward_coefficients(G, P, codes, 0.5, torch.float64)
    assert all(t.dtype == torch.float64 for t in (g_c, p_c, g_p))
    torch.testing.assert_close(g_c, (0.5 * G * c).double())
    torch.testing.assert_close(p_c, (0.5 * P * c).double())
    torch.testing.assert_close(g_p, (0.5 * G * P).double())
    with torch._subclasses.fake_tensor.FakeTensorMode():
        fakes = custom_ops.backward_coefficients(torch.empty(7, 4), torch.empty(7, 4), None, 1.0, torch.bfloat16)
    assert [tuple(t.shape) for t in fakes] == [(7, 4)] * 3 and all(t.dtype == torch.bfloat16 for t in fakes)


def test_backward_ops_fake_shapes():
    from bem.kernels import custom_ops

    with torch._subclasses.fake_tensor.FakeTensorMode():
        x, dy = torch.empty(3, 40, dtype=torch.bfloat16), torch.empty(3, 24, dtype=torch.bfloat16)
        V, U = torch.empty(40, 8, dtype=torch.bfloat16), torch.empty(24, 8, dtype=torch.bfloat16)
        outs = custom_ops.decode_backward(x, dy, None, V, U, torch.empty(3, 8), None, 1.0)
        prefill = custom_ops.prefill_backward(x, dy, torch.empty(24, 40, dtype=torch.bfloat16), V, U,
                                              torch.empty(3, 8), None, 1.0)
    for got in (outs, prefill):
        assert [tuple(t.shape) for t in got] == [(3, 40), (40, 8), (3, 8), (24, 8)]


@pytest.mark.parametrize("context,choices,setter", [
    ("prefill_dx_path", ("update", "gemm"), "set_prefill_dx_path"),
    ("prefill_grads_path", ("composed", "fused"), "set_prefill_grads_path"),
])
def test_forced_backward_paths_name_the_choices_and_are_set_in_the_extension_nested(context, choices, setter,
                                                                                    monkeypatch):
    """The C++ autograd function's backward reads a forced path from the extension: each context sets it there
    (-1 by shape, then the choice's index), restores it on exit, nested too, and refuses a name it lacks."""
    from types import SimpleNamespace

    from bem.kernels import custom_ops

    force = getattr(custom_ops, context)
    with pytest.raises(ValueError, match=rf"must be one of \('{choices[0]}', '{choices[1]}'\) or None, got 'cublas'"):
        with force("cublas"):
            pass
    seen = []
    monkeypatch.setattr(custom_ops, "_C", SimpleNamespace(**{setter: seen.append}))
    forced = custom_ops.PREFILL_DX_PATH if context == "prefill_dx_path" else custom_ops.PREFILL_GRADS_PATH
    with force(choices[1]):
        assert forced.current == choices[1]
        with force(choices[0]):
            assert forced.current == choices[0]
        assert forced.current == choices[1]
    assert forced.current is None
    assert seen == [1, 0, 1, -1]


@pytest.mark.parametrize("value,uses_reference", [(None, False), ("1", False), ("0", True)])
def test_training_takes_the_fused_ops_unless_bem_fused_training_is_0(value, uses_reference):
    import os

    env = {k: v for k, v in os.environ.items() if k != "BEM_FUSED_TRAINING"}
    if value is not None:
        env["BEM_FUSED_TRAINING"] = value
    code = "from bem.kernels import ops; print(ops.TRAINING_USES_REFERENCE)"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(uses_reference)



@pytest.mark.parametrize("module,form,shapes", [
    ("bem.kernels.bench", "MxKxNxR", "1x4096x4096"), ("bem.kernels.bench", "MxKxNxR", "1x4096x4096x0"),
    ("bem.kernels.bench", "MxKxNxR", "1xax2x3"), ("bem.kernels.fftconv.bench", "BxHxL", "8x768"),
    ("bem.kernels.fftconv.bench", "BxHxL", "8x768x0"), ("bem.kernels.fftconv.bench", "BxHxL", "1x2x3,axbxc"),
])
def test_benchmarks_refuse_a_malformed_shape(module, form, shapes, capsys):
    import importlib

    with pytest.raises(SystemExit) as exit_info:
        importlib.import_module(module).main(["--shapes", shapes])
    assert exit_info.value.code == 2
    assert f"a shape is {form} with positive integers" in capsys.readouterr().err


def test_benchmark_shapes_parse():
    from bem.kernels import bench
    from bem.kernels.fftconv import bench as fftconv_bench

    assert bench.parse_shapes("1x4096x4096x8, 16x2048x8192x32") == [(1, 4096, 4096, 8), (16, 2048, 8192, 32)]
    assert fftconv_bench._shapes("1x768x1048576, 8x864x3000") == [(1, 768, 1048576), (8, 864, 3000)]


def test_the_fftconv_benchmark_compares_each_unaligned_length_with_an_aligned_one_of_its_transform_size():
    from bem.kernels.fftconv import bench as fftconv_bench

    assert [fftconv_bench.transform_size(L) for L in (1, 1000, 1021, 1024, 1025, 3000, 4096)] == \
        [2, 2048, 2048, 2048, 4096, 8192, 8192]
    pairs = dict(fftconv_bench.same_transform_pairs(
        [(8, 768, 1024), (8, 768, 1021), (8, 768, 1016), (2, 768, 3001), (2, 768, 3000), (4, 768, 3001),
         (8, 864, 3000), (8, 768, 4096), (8, 768, 2049), (8, 768, 2047)]))
    assert pairs[(8, 768, 1021)] == (8, 768, 1024)  # the nearer of 1016 and 1024
    assert pairs[(2, 768, 3001)] == (2, 768, 3000)  # the same batch only
    assert pairs[(8, 864, 3000)] == (8, 768, 4096)  # an aligned length against the power of two
    assert pairs[(8, 768, 2049)] == (8, 864, 3000)  # the nearest aligned length, per row whatever its H
    assert (4, 768, 3001) not in pairs and (8, 768, 2047) not in pairs  # no peer of its batch or transform size
    assert (8, 768, 1024) not in pairs and (8, 768, 4096) not in pairs
