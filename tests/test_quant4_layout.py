"""The 4-bit layout the fused kernel reads, checked against bitsandbytes itself on the CPU: the PyTorch reference
(`bem.kernels.quant.reference`) dequantizes to exactly what bitsandbytes does for NF4 and FP4, with and without
double quantization; what a wrapped `Linear4bit` hands the kernel; and where the kernel declines a call (every
CPU call: the caller then runs the layer as it is)."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e '.[test]')")
import bitsandbytes.functional as bnb_functional  # noqa: E402

from bem.kernels.quant import ops as quant_ops  # noqa: E402
from bem.kernels.quant import reference  # noqa: E402


def quantized(N: int, K: int, quant_type: str, nested: bool, blocksize: int = 64, seed: int = 0):
    W = torch.randn(N, K, generator=torch.Generator().manual_seed(seed))
    try:
        packed, state = bnb_functional.quantize_4bit(W, blocksize=blocksize, quant_type=quant_type,
                                                     compress_statistics=nested)
    except (RuntimeError, NotImplementedError) as err:
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {err}")
    return W, packed, state


def as_weight(packed, state) -> reference.Quant4Weight:
    weight = quant_ops.weight_from_state(packed, state)
    assert weight is not None
    return weight


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double"])
@pytest.mark.parametrize("shape,blocksize", [((96, 128), 64), ((40, 192), 64), ((130, 256), 128)])
def test_the_reference_dequantizes_as_bitsandbytes(quant_type, nested, shape, blocksize):
    """K a multiple of the block size here: bitsandbytes' CPU dequantization reads a block that spans two rows
    otherwise than its quantization wrote it (the GPU test covers such blocks against its CUDA path)."""
    _, packed, state = quantized(*shape, quant_type, nested, blocksize)
    expected = bnb_functional.dequantize_4bit(packed, state).float()
    assert torch.equal(reference.dequantize(as_weight(packed, state)), expected)


def test_the_reference_linear_adds_the_update_and_bias_in_float64():
    _, packed, state = quantized(48, 64, "nf4", nested=True)
    weight = as_weight(packed, state)
    g = torch.Generator().manual_seed(1)
    x, V, U = torch.randn(3, 64, generator=g), torch.randn(64, 4, generator=g), torch.randn(48, 4, generator=g)
    codes, bias = torch.rand(3, 4, generator=g), torch.randn(48, generator=g)
    y = reference.quant4_linear(x.double(), weight, bias, V, codes, U, 0.5)
    W = reference.dequantize(weight, torch.float64)
    expected = x.double() @ W.t() + 0.5 * ((x.double() @ V.double()) * codes.double()) @ U.double().t() + bias.double()
    assert y.dtype == torch.float64 and torch.allclose(y, expected, rtol=0, atol=1e-12)


@pytest.fixture
def linear4bit():
    layer = bnb.nn.Linear4bit(64, 32, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True)
    with torch.no_grad():
        layer.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="nf4",
                                         compress_statistics=True)
    try:
        layer = layer.to("cpu")
        layer.weight._quantize("cpu") if not layer.weight.bnb_quantized else None
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        pytest.skip(f"bitsandbytes cannot quantize a Linear4bit on this CPU: {err}")
    return layer


def test_a_linear4bit_hands_the_kernel_its_own_tensors(linear4bit):
    weight = quant_ops.quant4_weight(linear4bit)
    assert weight is not None
    assert (weight.out_features, weight.in_features, weight.blocksize) == (32, 64, linear4bit.weight.quant_state.blocksize)
    assert weight.packed.data_ptr() == linear4bit.weight.data_ptr()
    assert weight.absmax2 is not None and weight.code2 is not None and weight.absmax.dtype == torch.uint8
    expected = bnb_functional.dequantize_4bit(linear4bit.weight.data, linear4bit.weight.quant_state).float()
    assert torch.equal(reference.dequantize(weight), expected)


def test_other_layers_have_no_4bit_weight():
    assert quant_ops.quant4_weight(torch.nn.Linear(64, 32)) is None
    int8 = bnb.nn.Linear8bitLt(64, 32, has_fp16_weights=False)
    assert quant_ops.quant4_weight(int8) is None


def test_the_kernel_declines_what_it_does_not_take(linear4bit):
    """CPU tensors, float32, a compute dtype other than x's: the caller runs the layer."""
    x = torch.randn(2, 64, dtype=torch.bfloat16)
    V, U = torch.randn(64, 4, dtype=torch.bfloat16), torch.zeros(32, 4, dtype=torch.bfloat16)
    assert not quant_ops.takes(linear4bit, x, V, U)  # on the CPU
    assert quant_ops.fused_linear(linear4bit, x, V, None, U, 1.0) is None
    meta = dict(device="meta")
    x_cuda_like = torch.empty(2, 64, dtype=torch.float32, **meta)
    assert not quant_ops.takes(linear4bit, x_cuda_like, V.to(**meta), U.to(**meta))


def test_a_gradient_is_wanted_for_any_trained_operand_under_grad_mode():
    """Which of the extension's two calls above decode sizes a call takes: its autograd function or the plain one."""
    x, V, U = torch.randn(2, 64), torch.randn(64, 4), torch.randn(32, 4)
    codes = torch.randn(2, 4)
    assert not quant_ops.wants_grad(x, V, U, codes)
    for trained in (x, V, U, codes):
        trained.requires_grad_(True)
        assert quant_ops.wants_grad(x, V, U, codes)
        with torch.no_grad():
            assert not quant_ops.wants_grad(x, V, U, codes)
        trained.requires_grad_(False)


def test_a_layer_weight_is_read_once_and_again_after_it_is_replaced(linear4bit):
    first = quant_ops.kept_weight(linear4bit)
    assert quant_ops.kept_weight(linear4bit) is first
    linear4bit.weight = bnb.nn.Params4bit(torch.randn(32, 64), requires_grad=False, quant_type="fp4",
                                          compress_statistics=False)
    try:
        linear4bit.weight._quantize("cpu")
    except (RuntimeError, NotImplementedError, AttributeError) as err:
        pytest.skip(f"bitsandbytes cannot quantize on this CPU: {err}")
    second = quant_ops.kept_weight(linear4bit)
    assert second is not first and second.absmax2 is None
    assert second.packed.data_ptr() == linear4bit.weight.data_ptr()


def test_the_kernel_takes_wide_row_counts_only_on_weights_where_it_was_measured_faster():
    small = reference.Quant4Weight(packed=torch.empty(0), absmax=torch.empty(0), code=torch.empty(16), blocksize=64,
                                   out_features=4096, in_features=4096)
    large = reference.Quant4Weight(packed=torch.empty(0), absmax=torch.empty(0), code=torch.empty(16), blocksize=64,
                                   out_features=14336, in_features=4096)
    assert quant_ops.takes_shape(16, small) and quant_ops.takes_shape(4, large)
    assert not quant_ops.takes_shape(5, large) and not quant_ops.takes_shape(16, large)
