"""The 4-bit path above decode sizes: the weight dequantized by BEM's kernel (against bitsandbytes' own
dequantization and a float64 reference), the linear with the update inside (against float64), its autograd
function (gradients for x, V, U and the codes against float64; no 16-bit weight kept for the backward), and a
wrapped 4-bit model whose prefill and training step take it, against the same model on bitsandbytes' layer plus the
update."""

from __future__ import annotations

import pytest
import torch

from bem.kernels import custom_ops, ops
from bem.kernels.quant import reference

from .kernel_helpers import bound, poison_allocator, rel_err, stable_seed
from .test_quant4_kernel import bad_operands, counted_4bit_calls, operands, quantized_weight, tiny_4bit_bem

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
import bitsandbytes.functional as bnb_functional  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]

QUANTS = [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant_type,nested", QUANTS)
@pytest.mark.parametrize("N,K,blocksize", [(40, 96, 64), (200, 320, 128), (77, 4864, 256), (4096, 1024, 64)])
def test_dequantize_matches_bitsandbytes_and_float64(dtype, quant_type, nested, N, K, blocksize):
    """Every value within one rounding to the dtype of the float64 dequantization and of bitsandbytes' own (a value
    read from the wrong block or nibble would be off by its whole size); the output starts as NaN."""
    weight, packed, state = quantized_weight(N, K, quant_type, nested, blocksize, seed=stable_seed(N, K, quant_type))
    like = torch.empty(1, K, device="cuda", dtype=dtype)
    poison_allocator(like.device, N * K)
    ours = custom_ops.extension().quant4_dequantize(like, *weight.layout_args(), K)
    assert ours.dtype == dtype and ours.shape == (N, K)
    exact = reference.dequantize(weight, torch.float64)
    step = torch.finfo(dtype).eps  # one step of the dtype at 1: a rounding moves a value by at most half of that
    assert ((ours.double() - exact).abs() <= exact.abs() * step / 2 * 1.001).all()
    theirs = bnb_functional.dequantize_4bit(packed, state)  # in the quantized weight's dtype (bf16)
    step = max(step, torch.finfo(theirs.dtype).eps)
    assert ((ours.double() - theirs.double()).abs() <= theirs.double().abs() * step * 1.001).all()


@pytest.mark.parametrize("quant_type,nested", QUANTS)
@pytest.mark.parametrize("lead", [(17,), (64,), (3, 111), (1024,)])
@pytest.mark.parametrize("N,K,r,blocksize", [(77, 320, 13, 128), (896, 896, 8, 64), (4864, 896, 16, 64),
                                             (896, 4864, 8, 256)])
def test_linear_matches_float64(quant_type, nested, lead, N, K, r, blocksize):
    """x (..., K) above the decode kernel's rows: error at most 2x that of PyTorch computing the same dequantized
    product in bf16; with and without codes and bias; outputs start as NaN."""
    dtype = torch.bfloat16
    seed = stable_seed(quant_type, nested, lead, N, K, r, blocksize)
    weight, _, _ = quantized_weight(N, K, quant_type, nested, blocksize, seed)
    M = int(torch.tensor(lead).prod())
    with_extras = M % 2 == 1
    x, V, c, U, b = operands(M, K, N, r, dtype, seed, codes=with_extras, bias=with_extras)
    x = x.reshape(*lead, K)
    c = None if c is None else c.reshape(*lead, r)
    expected = reference.quant4_linear(x.double(), weight, b, V, c, U, 0.75, torch.float64)
    in_dtype = reference.quant4_linear(x, weight, b, V, c, U, 0.75, dtype)
    poison_allocator(x.device, M * N)
    y = custom_ops.extension().quant4_linear(x, *weight.layout_args(), b, V, c, U, 0.75)
    assert y.dtype == dtype and y.shape == (*lead, N)
    assert rel_err(y, expected) <= bound(rel_err(in_dtype, expected), dtype)


def _grads(fn, x, V, c, U, gy):
    leaves = [t for t in (x, V, c, U) if t is not None and t.requires_grad]
    y = fn(x, V, c, U)
    return y, torch.autograd.grad((y.to(gy.dtype) * gy).sum(), leaves)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("M", [5, 64, 300])
@pytest.mark.parametrize("needs", ["all", "no_x", "no_codes"])
def test_autograd_gradients_match_float64(dtype, M, needs):
    """Gradients for x (where it needs one), V, U and the codes against float64 autograd of the reference; each at
    most 2x PyTorch's error in the dtype. 5 and 64 rows take the decode-size backward, 300 the prefill one."""
    N, K, r, blocksize = 896, 640, 8, 64
    seed = stable_seed(str(dtype), M, needs)
    weight, _, _ = quantized_weight(N, K, "nf4", True, blocksize, seed)
    x, V, c, U, b = operands(M, K, N, r, dtype, seed, codes=needs != "no_codes", bias=True)
    gy = torch.randn(M, N, device="cuda", generator=torch.Generator(device="cuda").manual_seed(seed + 9))

    def leafs(kind):
        cast = (lambda t: t.double()) if kind == "ref" else (lambda t: t.clone())
        out = [None if t is None else cast(t).requires_grad_(name != "x" or needs != "no_x")
               for name, t in (("x", x), ("V", V), ("c", c), ("U", U))]
        return out

    def kernel(x_, V_, c_, U_):
        return custom_ops.extension().quant4_fused_linear(x_, *weight.layout_args(), b, V_, c_, U_, 0.5)

    def ref(x_, V_, c_, U_):
        return reference.quant4_linear(x_, weight, b, V_, c_, U_, 0.5, x_.dtype)

    y, got = _grads(kernel, *leafs("kernel"), gy.to(dtype))
    y_ref, expected = _grads(ref, *leafs("ref"), gy.double())
    _, in_dtype = _grads(ref, *leafs("in_dtype"), gy.to(dtype))
    assert rel_err(y, y_ref) <= bound(rel_err(ref(*leafs("in_dtype")), y_ref), dtype)
    assert len(got) == len(expected) == (3 if needs != "all" else 4)
    for g, e, p in zip(got, expected, in_dtype):
        assert g.dtype == dtype and g.shape == e.shape
        assert rel_err(g, e) <= bound(rel_err(p, e), dtype), (rel_err(g, e), rel_err(p, e))


def test_autograd_keeps_no_16bit_weight():
    """What the forward leaves for the backward is x, the codes and the layer's own packed tensors: the 32 MiB
    bf16 weight it multiplied by is freed on return."""
    N = K = 4096
    weight, _, _ = quantized_weight(N, K, "nf4", True, 64, seed=11)
    x, V, c, U, b = operands(64, K, N, 8, torch.bfloat16, seed=11, codes=True, bias=False)
    V.requires_grad_(True)
    # a first call: what a process's first calls allocate for good (cuBLAS's workspace) is not counted as held
    custom_ops.extension().quant4_fused_linear(x, *weight.layout_args(), None, V, c, U, 1.0).float().sum().backward()
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    before = torch.cuda.memory_allocated()
    y = custom_ops.extension().quant4_fused_linear(x, *weight.layout_args(), None, V, c, U, 1.0)
    torch.cuda.synchronize()
    held = torch.cuda.memory_allocated() - before
    assert held < N * K * 2 / 8, held / 2**20  # y is 0.5 MiB; the weight would be 32 MiB
    (grad_v,) = torch.autograd.grad(y.float().sum(), [V])
    assert torch.isfinite(grad_v).all()


def test_autograd_refuses_a_trained_bias():
    weight, _, _ = quantized_weight(64, 128, "nf4", False, 64, seed=3)
    x, V, c, U, b = operands(20, 128, 64, 4, torch.bfloat16, seed=3)
    with pytest.raises(ValueError, match="bias must not require grad"):
        custom_ops.extension().quant4_fused_linear(x, *weight.layout_args(), b.requires_grad_(True), V, c, U, 1.0)


@pytest.mark.parametrize("what,change,message", [
    ("K", lambda a: a.update(x=a["x"][:, :100].contiguous()), "multiple of 32"),
    ("weight of another K", lambda a: a.update(x=a["x"][:, :96].contiguous()), "weight must hold"),
    ("float32 x", lambda a: a.update(x=a["x"].float()), "float16 or bfloat16"),
    ("strided x", lambda a: a.update(x=a["x"].t().contiguous().t()), "x must be contiguous"),
    ("absmax dtype", lambda a: a.update(absmax=a["absmax"].half()), "absmax must be"),
    ("code size", lambda a: a.update(code=a["code"][:8]), "code must hold"),
    ("half nested", lambda a: a.update(code2=None), "come together"),
    ("V rows", lambda a: a.update(V=a["V"][:-1].contiguous()), "V"),
])
def test_bad_operands_raise_value_errors_naming_them(what, change, message):
    args = bad_operands(40, what, change)
    for name in ("quant4_linear", "quant4_fused_linear"):
        with pytest.raises(ValueError, match=message):
            getattr(custom_ops.extension(), name)(**args)


def test_a_wrapped_4bit_model_prefills_and_trains_through_the_4bit_path(tmp_path):
    """A training step (loss and every adapter gradient) and an inference prefill of a 4-bit Llama with BEM: the
    4-bit path against the same model with BEM's kernels off (bitsandbytes' layer plus the update), and the path
    was taken."""
    ids = torch.randint(1, 512, (2, 40), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    results = {}
    for fused in (True, False):
        model = tiny_4bit_bem(tmp_path, fused).train()
        with counted_4bit_calls() as calls:
            loss = model(input_ids=ids, labels=ids).loss
            loss.backward()
            trained = sum(calls)
            model.eval()
            with torch.no_grad():
                logits = model(input_ids=ids).logits.float()
        grads = {name: p.grad.float().clone() for name, p in model.named_parameters() if p.grad is not None}
        results[fused] = (loss.item(), grads, logits, trained, sum(calls) - trained)
    fused, plain = results[True], results[False]
    assert fused[3] > 0 and fused[4] > 0 and plain[3] == plain[4] == 0
    assert abs(fused[0] - plain[0]) < 1e-2 * abs(plain[0])
    assert fused[1].keys() == plain[1].keys() and any("bem_V" in name for name in fused[1])
    for name in plain[1]:
        if plain[1][name].abs().max() == 0:  # nothing reaches it at initialisation (the routing heads start at zero)
            assert fused[1][name].abs().max() == 0, name
        else:
            assert rel_err(fused[1][name], plain[1][name]) < 3e-2, name
    assert rel_err(fused[2], plain[2]) < 1e-2
