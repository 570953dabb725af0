"""Shared fixtures: tiny models of each supported architecture, saved and reloaded as 'pretrained'."""

from __future__ import annotations

import logging
import os

import pytest
import torch
from transformers import (
    AutoModelForCausalLM,
    AutoModelForMaskedLM,
    BertConfig,
    GPT2Config,
    GPTNeoXConfig,
    LlamaConfig,
    MistralConfig,
    Qwen2Config,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# BEM_TEST_THREADS: CI runs two suites side by side (two transformers releases), one thread each
torch.set_num_threads(int(os.environ.get("BEM_TEST_THREADS", 0)) or max(1, min(2, os.cpu_count() or 1)))

VOCAB = 97
_COMMON = dict(vocab_size=VOCAB, pad_token_id=0, bos_token_id=1, eos_token_id=None)
_DECODER = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=128, **_COMMON)

TINY_CONFIGS = {
    "llama": lambda: LlamaConfig(**_DECODER),
    "mistral": lambda: MistralConfig(sliding_window=None, **_DECODER),
    "qwen2": lambda: Qwen2Config(**_DECODER),
    "gpt2": lambda: GPT2Config(n_embd=32, n_layer=2, n_head=4, n_positions=128, resid_pdrop=0.0, embd_pdrop=0.0,
                               attn_pdrop=0.0, **_COMMON),
    "gpt_neox": lambda: GPTNeoXConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                      num_attention_heads=4, max_position_embeddings=128, hidden_dropout=0.0,
                                      attention_dropout=0.0, **_COMMON),
    "bert": lambda: BertConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                               max_position_embeddings=128, hidden_dropout_prob=0.0,
                               attention_probs_dropout_prob=0.0, vocab_size=VOCAB, pad_token_id=0),
}
DECODERS = ["llama", "mistral", "qwen2", "gpt2", "gpt_neox"]
ARCHITECTURES = DECODERS + ["bert"]


@pytest.fixture(scope="session")
def pretrained_dirs(tmp_path_factory):
    """Each tiny architecture with random weights, written with save_pretrained once per session."""
    dirs = {}
    for arch, make_config in TINY_CONFIGS.items():
        torch.manual_seed(1234)
        config = make_config()
        cls = AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM
        model = cls.from_config(config)
        path = tmp_path_factory.mktemp(f"pretrained_{arch}")
        model.save_pretrained(path)
        dirs[arch] = path
    return dirs


@pytest.fixture
def load_base(pretrained_dirs):
    """load_base(arch) -> a fresh copy of the tiny pretrained model, in eval mode, float32."""

    def load(arch: str):
        cls = AutoModelForMaskedLM if arch == "bert" else AutoModelForCausalLM
        return cls.from_pretrained(pretrained_dirs[arch], dtype=torch.float32).eval()

    return load


@pytest.fixture(scope="module")
def one_thread():
    """One intra-op thread for a test module: tiny models gain nothing from more, and on a shared CPU
    the threads stall on each other."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def randomize_bem(model, seed: int = 0, scale: float = 0.3) -> None:
    """Give every BEM parameter random values so the update and every routing level matter."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            if ".bem_" in name or name.startswith("controller."):
                noise = torch.randn(param.shape, generator=generator) * scale
                if name.endswith("static_codes"):
                    param.copy_(1.0 + noise)
                elif name.endswith("gate.bias"):
                    param.copy_(torch.full_like(param, 0.5))
                elif param.dim() >= 1:
                    param.copy_(noise.to(param.dtype))


def random_ids(batch: int, length: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(3, VOCAB, (batch, length), generator=generator)


class _DeprecationRecords(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if "deprecated" in message and ("past_key_values" in message or "cache_params" in message):
            self.messages.append(message)


@pytest.fixture(autouse=True)
def no_deprecated_cache_names():
    """transformers' deprecation notices about the cache's old names are errors: neither BEM nor its tests may
    use them. Some come as FutureWarnings (pytest.ini makes those errors), others through transformers' logger,
    once per process: that memory is cleared, and the logger watched, for each test."""
    from transformers.utils import logging as hf_logging

    logger = hf_logging.get_logger("transformers")
    records = _DeprecationRecords()
    level = logger.level
    logger.setLevel(logging.WARNING)
    logger.addHandler(records)
    clear = getattr(getattr(hf_logging, "warning_once", None), "cache_clear", None)
    if clear is not None:
        clear()
    try:
        yield
    finally:
        logger.removeHandler(records)
        logger.setLevel(level)
    assert not records.messages, f"transformers warned that a deprecated cache name was used: {records.messages[0]}"


def pytest_collection_modifyitems(config, items):
    """Tests marked `gpu` skip cleanly, with the reason shown, where CUDA is absent."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
