"""A byte-level tokenizer built locally (no download), for freshly initialised models.

Every UTF-8 byte is one token (256 ids), plus `<pad>`, `<s>` and `</s>`. It is a regular
`PreTrainedTokenizerFast`, so it saves with the model and loads back with `AutoTokenizer`.
"""

from __future__ import annotations

from transformers import PreTrainedTokenizerFast

SPECIAL_TOKENS = {"pad_token": "<pad>", "bos_token": "<s>", "eos_token": "</s>"}


def byte_level_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from tokenizers.pre_tokenizers import ByteLevel

    alphabet = ByteLevel.alphabet()  # the 256 printable stand-ins for the bytes 0..255
    vocab = {symbol: index for index, symbol in enumerate(sorted(alphabet))}
    for offset, token in enumerate(SPECIAL_TOKENS.values()):
        vocab[token] = len(alphabet) + offset
    # BPE without merges over the byte alphabet: exactly one token per byte
    tokenizer = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tokenizer.decoder = decoders.ByteLevel()
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, **SPECIAL_TOKENS)
    fast.add_bos_token = False
    return fast
