"""The fused 4-bit decode kernel (bitsandbytes' NF4 / FP4 layout, with and without double quantization, and BEM's
update in one pass) against a float64 reference of the same dequantized weight, against bitsandbytes' own layer
plus the update (the oracle), its error messages, and a wrapped 4-bit model whose cached decoding takes it."""

from __future__ import annotations

import contextlib

import pytest
import torch

from bem.kernels import custom_ops, ops
from bem.kernels.quant import ops as quant_ops
from bem.kernels.quant import reference

from .kernel_helpers import bound, poison_allocator, rel_err, stable_seed

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed")
import bitsandbytes.functional as bnb_functional  # noqa: E402

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not ops.KERNELS_AVAILABLE, reason="BEM CUDA extension not loaded"),
]


def quantized_weight(N: int, K: int, quant_type: str, nested: bool, blocksize: int, seed: int):
    g = torch.Generator(device="cuda").manual_seed(seed)
    W = torch.randn(N, K, device="cuda", generator=g, dtype=torch.float32).to(torch.bfloat16)
    packed, state = bnb_functional.quantize_4bit(W, blocksize=blocksize, quant_type=quant_type,
                                                 compress_statistics=nested)
    weight = reference.Quant4Weight(
        packed=packed, absmax=state.absmax, code=state.code, blocksize=state.blocksize, out_features=N,
        in_features=K, absmax2=state.state2.absmax if nested else None, code2=state.state2.code if nested else None,
        offset=float(state.offset) if nested else 0.0, blocksize2=state.state2.blocksize if nested else 0)
    return weight, packed, state


@contextlib.contextmanager
def counted_4bit_calls():
    """A list that gets one bool per wrapped 4-bit layer's call: whether BEM's 4-bit path took it."""
    calls: list[bool] = []
    original = quant_ops.fused_linear

    def counting(*args, **kwargs):
        y = original(*args, **kwargs)
        calls.append(y is not None)
        return y

    quant_ops.fused_linear = counting
    try:
        yield calls
    finally:
        quant_ops.fused_linear = original


def call(x, weight, bias, V, codes, U, scaling):
    return custom_ops.extension().quant4_linear_decode(x, *weight.layout_args(), bias, V, codes, U, scaling)


def operands(M, K, N, r, dtype, seed, codes=True, bias=True):
    g = torch.Generator(device="cuda").manual_seed(seed + 1)
    x = torch.randn(M, K, device="cuda", generator=g).to(dtype)
    V = (torch.randn(K, r, device="cuda", generator=g) / K**0.5).to(dtype)
    U = (0.2 * torch.randn(N, r, device="cuda", generator=g)).to(dtype)
    c = (1 + 0.5 * torch.randn(M, r, device="cuda", generator=g)).to(dtype) if codes else None
    b = torch.randn(N, device="cuda", generator=g).to(dtype) if bias else None
    return x, V, c, U, b


@pytest.mark.parametrize("quant_type", ["nf4", "fp4"])
@pytest.mark.parametrize("nested", [False, True], ids=["plain", "double"])
def test_the_reference_layout_is_bitsandbytes_cuda_layout(quant_type, nested):
    """Blocks that span two rows (K = 96, blocksize 64) included."""
    for N, K, blocksize in [(40, 96, 64), (200, 320, 128), (4096, 1024, 64)]:
        weight, packed, state = quantized_weight(N, K, quant_type, nested, blocksize, seed=N)
        expected = bnb_functional.dequantize_4bit(packed, state)  # in the quantized weight's bf16
        ours = reference.dequantize(weight, torch.float32)
        # the same values up to bitsandbytes' rounding to bf16 (a value read from the wrong block or nibble would
        # be off by its whole size)
        assert ((ours - expected.float()).abs() <= ours.abs() * 2**-8 + 1e-30).all(), (N, K, blocksize)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("quant_type,nested", [("nf4", False), ("nf4", True), ("fp4", False), ("fp4", True)])
@pytest.mark.parametrize("M", [1, 2, 3, 5, 8, 11, 16])
@pytest.mark.parametrize("N,K,r,blocksize", [(40, 96, 8, 64), (77, 320, 13, 128), (896, 896, 8, 64),
                                             (4864, 896, 16, 64), (896, 4864, 8, 256), (4104, 4096, 64, 64)])
def test_matches_float64(dtype, quant_type, nested, M, N, K, r, blocksize):
    """Error at most 2x that of PyTorch computing the same dequantized product in the same dtype; outputs start
    as NaN (a value the kernel does not write stays NaN and fails); with and without codes and bias."""
    seed = stable_seed(str(dtype), quant_type, nested, M, N, K, r, blocksize)
    weight, _, _ = quantized_weight(N, K, quant_type, nested, blocksize, seed)
    with_extras = M % 2 == 1
    x, V, c, U, b = operands(M, K, N, r, dtype, seed, codes=with_extras, bias=with_extras)
    expected = reference.quant4_linear(x.double(), weight, b, V, c, U, 0.75, torch.float64)
    in_dtype = reference.quant4_linear(x, weight, b, V, c, U, 0.75, dtype)
    poison_allocator(x.device, M * N)
    y = call(x, weight, b, V, c, U, 0.75)
    assert y.dtype == dtype and y.shape == (M, N)
    assert rel_err(y, expected) <= bound(rel_err(in_dtype, expected), dtype)


def test_equals_bitsandbytes_layer_plus_the_update():
    """The oracle: a real `Linear4bit` (NF4, double quantization, bf16 compute) called as it is, plus the update."""
    layer = bnb.nn.Linear4bit(1024, 2048, bias=True, compute_dtype=torch.bfloat16, quant_type="nf4",
                              compress_statistics=True).to(torch.bfloat16)
    layer.weight = bnb.nn.Params4bit(torch.randn(2048, 1024, dtype=torch.bfloat16), requires_grad=False,
                                     quant_type="nf4", compress_statistics=True)
    layer = layer.cuda()
    x, V, c, U, _ = operands(4, 1024, 2048, 8, torch.bfloat16, seed=7)
    with torch.no_grad():
        oracle = layer(x).double() + 0.5 * (((x.double() @ V.double()) * c.double()) @ U.double().t())
        y = quant_ops.fused_linear(layer, x, V, c, U, 0.5)
    assert y is not None
    assert rel_err(y, oracle) < 1e-2


@pytest.mark.parametrize("what,change,message", [
    ("rows", lambda a: a.update(x=a["x"].new_zeros(17, 128)), "at most 16"),
    ("K", lambda a: a.update(x=a["x"][:, :100].contiguous()), "multiple of 32"),
    ("weight of another K", lambda a: a.update(x=a["x"][:, :96].contiguous()), "weight must hold"),
    ("float32 x", lambda a: a.update(x=a["x"].float()), "float16 or bfloat16"),
    ("absmax dtype", lambda a: a.update(absmax=a["absmax"].half()), "absmax must be"),
    ("short weight", lambda a: a.update(weight=a["weight"][:-2]), "weight must hold"),
    ("code size", lambda a: a.update(code=a["code"][:8]), "code must hold"),
    ("U rows", lambda a: a.update(U=a["U"][:-1].contiguous()), "U must hold"),
    ("codes shape", lambda a: a.update(codes=a["codes"][:, :3].contiguous()), "codes must hold"),
    ("half nested", lambda a: a.update(code2=None), "come together"),
    ("blocksize", lambda a: a.update(blocksize=48), "multiple of 32"),
])
def test_bad_operands_raise_value_errors_naming_them(what, change, message):
    args = bad_operands(2, what, change)
    with pytest.raises(ValueError, match=message):
        custom_ops.extension().quant4_linear_decode(**args)


def bad_operands(rows: int, what: str, change) -> dict:
    """The 4-bit bindings' keyword operands for a 64 x 128 NF4 weight and `rows` rows of x, then changed."""
    weight, _, _ = quantized_weight(64, 128, "nf4", False, 64, seed=3)
    x, V, c, U, b = operands(rows, 128, 64, 4, torch.bfloat16, seed=3)
    args = dict(x=x, weight=weight.packed, absmax=weight.absmax, code=weight.code, absmax2=None, code2=None,
                offset=0.0, blocksize=64, blocksize2=0, out_features=64, bias=b, V=V, codes=c, U=U, scaling=1.0)
    if what == "half nested":
        args["absmax2"] = torch.ones(1, device="cuda")
    change(args)
    return args


def tiny_4bit_bem(tmp_path, fused: bool):
    """A 2-layer Llama saved under tmp_path (once), loaded in NF4 (double quantization, bf16 compute), with BEM at
    rank 8 on every projection; the same adapters and controller for both values of `fused`, U drawn nonzero."""
    from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig

    from bem import HierarchicalBEMConfig, create_hierarchical_bem

    if not any(tmp_path.iterdir()):
        torch.manual_seed(0)
        config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=704, num_hidden_layers=2,
                             num_attention_heads=4, num_key_value_heads=2, pad_token_id=0, eos_token_id=None)
        AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    quantization = BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_use_double_quant=True,
                                      bnb_4bit_compute_dtype=torch.bfloat16)
    base = AutoModelForCausalLM.from_pretrained(tmp_path, quantization_config=quantization, device_map="cuda",
                                                dtype=torch.bfloat16)
    torch.manual_seed(1)  # the same V and controller for both
    model = create_hierarchical_bem(base, HierarchicalBEMConfig(rank=8, attach_qkv=True, use_fused_kernels=fused))
    generator = torch.Generator(device="cuda").manual_seed(5)
    with torch.no_grad():
        for _, module in model.bem_modules():
            module.bem_U.copy_(0.05 * torch.randn(module.bem_U.shape, device="cuda", generator=generator))
    return model



def test_a_wrapped_4bit_model_decodes_through_the_kernel(tmp_path):
    """Greedy cached decoding of a 4-bit Llama with BEM: the kernel's tokens and logits against the same model with
    BEM's kernels off (bitsandbytes' layer plus the update), and the kernel was called."""
    outputs = {}
    for fused in (True, False):
        model = tiny_4bit_bem(tmp_path, fused).eval()
        with counted_4bit_calls() as calls:
            ids = torch.randint(1, 512, (2, 9), device="cuda", generator=torch.Generator(device="cuda").manual_seed(6))
            out = model.generate(ids, max_new_tokens=6, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        outputs[fused] = (out.sequences, torch.stack(out.logits).float(), sum(calls))
    assert outputs[True][2] > 0 and outputs[False][2] == 0
    # the two paths round differently (bf16), so a near tie may pick another token; compare the steps up to the
    # first that differs (its logits included), each step's logits on the same tokens before it
    fused_tokens, plain_tokens = outputs[True][0][:, 9:], outputs[False][0][:, 9:]
    differs = (fused_tokens != plain_tokens).any(dim=0).nonzero()
    steps = int(differs[0]) + 1 if len(differs) else fused_tokens.shape[1]
    gap = (outputs[True][1][:steps] - outputs[False][1][:steps]).abs().max().item()
    scale = outputs[False][1][:steps].abs().max().item()
    assert gap < 0.02 * scale + 1e-3, (gap, scale, steps)
