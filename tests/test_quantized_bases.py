"""BEM on a base quantized by bitsandbytes (QLoRA-style), on the CPU with the real library: NF4 and FP4 4-bit
layers (with and without double quantization) and 8-bit `Linear8bitLt`. Each quantized layer is called as it
is and the update is added beside it in the adapter's dtype; nothing of the frozen weight ever changes.

Outputs are compared under `torch.no_grad()`: on a CPU with AVX-512 bf16, bitsandbytes repacks a 4-bit weight
for its own CPU kernel at the first call that needs no gradient, and that kernel rounds otherwise than the
plain dequantizing path a call with gradients takes (about 1e-3 apart), whoever wraps the layer."""

from __future__ import annotations

import pytest
import torch

bnb = pytest.importorskip("bitsandbytes", reason="bitsandbytes is not installed (pip install -e '.[test]')")

from peft import LoraConfig, PeftModel, get_peft_model  # noqa: E402
from transformers import AutoModelForCausalLM, BitsAndBytesConfig, LlamaConfig  # noqa: E402

from bem import BEMModel, HierarchicalBEMConfig, create_hierarchical_bem  # noqa: E402

from conftest import VOCAB, random_ids, randomize_bem  # noqa: E402
from test_decoding_paths import full_forward_greedy, generate, left_padded  # noqa: E402

QUANTIZATIONS = {
    "nf4": dict(load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32),
    "fp4-double": dict(load_in_4bit=True, bnb_4bit_quant_type="fp4", bnb_4bit_use_double_quant=True,
                       bnb_4bit_compute_dtype=torch.float32),
    "int8": dict(load_in_8bit=True),
}
LAYER_TYPES = {"nf4": "Linear4bit", "fp4-double": "Linear4bit", "int8": "Linear8bitLt"}
# Cached decoding against the full forward: the codes of the two agree to float32 rounding, but the layers round
# their inputs coarsely (bitsandbytes' CPU 4-bit kernel computes in bfloat16 whatever the compute dtype; the 8-bit
# layer quantizes each input row to int8), so a last-bit difference can move an output by one such step.
TOLERANCE = {"nf4": 1e-3, "fp4-double": 1e-3, "int8": 2e-3}
PROJECTIONS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


@pytest.fixture(scope="module")
def quantizable_llama(tmp_path_factory):
    """A tiny Llama whose linears are at least 64 wide: bitsandbytes' CPU layout for 4-bit weights packs blocks of
    64 input features (a 32-wide layer fails inside the library at its first no-grad call)."""
    torch.manual_seed(4321)
    config = LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=0, bos_token_id=1, eos_token_id=None)
    path = tmp_path_factory.mktemp("quantizable_llama")
    AutoModelForCausalLM.from_config(config).save_pretrained(path)
    return path


@pytest.fixture
def load_quantized(quantizable_llama):
    """load_quantized(kind) -> the tiny Llama, quantized by bitsandbytes on the CPU as it loads."""

    def load(kind: str):
        try:
            model = AutoModelForCausalLM.from_pretrained(
                quantizable_llama, quantization_config=BitsAndBytesConfig(**QUANTIZATIONS[kind]),
                device_map="cpu", dtype=torch.float32)
        except (ImportError, RuntimeError) as err:  # a build of the library without a CPU backend
            pytest.skip(f"bitsandbytes cannot quantize on this CPU: {err}")
        return model.eval()

    return load


def wrapped(model, routing: bool = True, seed: int = 0) -> BEMModel:
    bem = create_hierarchical_bem(model, HierarchicalBEMConfig(
        rank=4, alpha=8.0, chunk_size=3, max_prefix_tokens=5, controller_dim=16, attach_qkv=True,
        enable_routing=routing))
    randomize_bem(bem, seed=seed)
    return bem


def frozen_weights(model) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in model.named_parameters() if ".bem_" not in name
            and not name.startswith("controller.")}


@pytest.mark.parametrize("kind", list(QUANTIZATIONS))
def test_wraps_the_quantized_layers_and_is_the_base_at_init(kind, load_quantized):
    ids = random_ids(2, 9, seed=1)
    with torch.no_grad():
        expected = load_quantized(kind)(input_ids=ids).logits
    bem = create_hierarchical_bem(load_quantized(kind), HierarchicalBEMConfig(rank=4, attach_qkv=True))
    wrapped_types = {type(module.base_layer).__name__ for _, module in bem.bem_modules()}
    assert wrapped_types == {LAYER_TYPES[kind]}
    assert len(bem.bem_modules()) == 2 * len(PROJECTIONS)
    assert all(m.bem_V.dtype == torch.float32 for _, m in bem.bem_modules())
    with torch.no_grad():
        assert torch.equal(bem(input_ids=ids).logits, expected)


@pytest.mark.parametrize("kind", list(QUANTIZATIONS))
def test_trains_the_adapters_and_leaves_the_quantized_weights_alone(kind, load_quantized):
    bem = create_hierarchical_bem(load_quantized(kind), HierarchicalBEMConfig(rank=4, attach_qkv=True))
    before = frozen_weights(bem)
    trainable = [p for p in bem.parameters() if p.requires_grad]
    assert trainable and all(".bem_" in n or n.startswith("controller.") for n, p in bem.named_parameters()
                             if p.requires_grad)
    optimizer = torch.optim.AdamW(trainable, lr=1e-2)
    ids = random_ids(2, 12, seed=2)
    bem.train()
    losses = []
    for _ in range(4):
        loss = bem(input_ids=ids, labels=ids).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    assert all(torch.isfinite(torch.tensor(losses))) and losses[-1] < losses[0]
    assert any(m.bem_U.abs().max() > 0 for _, m in bem.bem_modules())
    after = frozen_weights(bem)
    assert all(torch.equal(before[name], after[name]) for name in before)


@pytest.mark.parametrize("kind", list(QUANTIZATIONS))
def test_cached_decoding_equals_the_full_forward_with_left_padding(kind, load_quantized):
    bem = wrapped(load_quantized(kind), seed=3)
    ids, mask = left_padded(seed=4)
    with torch.no_grad():
        expected, expected_logits = full_forward_greedy(bem, ids, mask)
    tokens, logits = generate(bem, ids, mask)
    assert torch.equal(tokens, expected)
    assert (logits - expected_logits).abs().max().item() < TOLERANCE[kind]
    # each row of the padded batch decodes as it does alone
    alone, alone_logits = generate(bem, ids[1:, 3:], mask[1:, 3:])
    assert torch.equal(alone[:, -tokens.shape[1] + ids.shape[1]:], tokens[1:, ids.shape[1]:])
    assert (alone_logits - logits[1:]).abs().max().item() < TOLERANCE[kind]


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_saved_adapters_load_onto_a_freshly_quantized_base(kind, load_quantized, tmp_path):
    bem = wrapped(load_quantized(kind), seed=5)
    ids = random_ids(2, 9, seed=5)
    with torch.no_grad():
        expected = bem(input_ids=ids).logits
    bem.save_pretrained(tmp_path)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["adapter_config.json", "adapter_model.safetensors"]
    loaded = BEMModel.from_pretrained(load_quantized(kind), tmp_path)
    with torch.no_grad():
        assert torch.equal(loaded(input_ids=ids).logits, expected)


@pytest.mark.parametrize("kind", ["nf4", "int8"])
def test_merging_into_a_quantized_weight_is_refused_before_any_change(kind, load_quantized):
    bem = wrapped(load_quantized(kind), routing=False, seed=6)
    before = frozen_weights(bem)
    with pytest.raises(ValueError, match="cannot merge into a"):
        bem.merge_and_unload()
    after = frozen_weights(bem)
    assert all(torch.equal(before[name], after[name]) for name in before)


def qlora(model, seed: int):
    torch.manual_seed(seed)
    config = LoraConfig(r=4, lora_alpha=8.0, target_modules=PROJECTIONS, lora_dropout=0.0, init_lora_weights=False)
    return get_peft_model(model, config).eval()


@torch.no_grad()
def test_a_peft_qlora_adapter_comes_into_bem_and_goes_back(load_quantized, tmp_path):
    ids = random_ids(2, 10, seed=7)
    lora = qlora(load_quantized("nf4"), seed=7)
    expected = lora(input_ids=ids).logits
    lora.save_pretrained(tmp_path / "qlora")
    bem = BEMModel.from_peft_lora(load_quantized("nf4"), tmp_path / "qlora", enable_routing=False)
    assert {type(m.base_layer).__name__ for _, m in bem.bem_modules()} == {"Linear4bit"}
    got = bem(input_ids=ids).logits
    assert (got - expected).abs().max().item() < 1e-5
    assert (expected - load_quantized("nf4")(input_ids=ids).logits).abs().max().item() > 1e-3  # it matters
    bem.save_as_peft_lora(tmp_path / "back")
    back = PeftModel.from_pretrained(load_quantized("nf4"), tmp_path / "back").eval()
    assert (back(input_ids=ids).logits - expected).abs().max().item() < 1e-5
