"""A tokenizer the package makes, for models that come without one (a preset, a config-only directory):
byte-level, 256 byte tokens and three special ones, offline, for any UTF-8 text. Its ids are no
checkpoint's, so it suits random weights only: a pipeline smoke test, a memory or speed run."""

from __future__ import annotations

from streambp_core.config import ConfigError

SPECIAL_TOKENS = ("<pad>", "<s>", "</s>")
"""pad, bos and eos: ids 256, 257, 258, after the 256 bytes."""
BYTE_VOCAB_SIZE = 256 + len(SPECIAL_TOKENS)
"""The vocabulary the byte tokenizer needs the model to have, at least."""


def byte_tokenizer(vocab_size: int):
    """A `PreTrainedTokenizerFast` mapping every byte of UTF-8 text to one of ids 0-255 (GPT-2's byte
    alphabet, no merges), with pad, bos and eos after them; ConfigError when `vocab_size` is smaller than
    the 259 ids it uses."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < BYTE_VOCAB_SIZE:
        raise ConfigError(f"the byte tokenizer needs a vocabulary of at least {BYTE_VOCAB_SIZE} tokens, "
                          f"the model has {vocab_size}")
    alphabet = sorted(pre_tokenizers.ByteLevel.alphabet())  # 256 printable stand-ins for the bytes
    vocab = {**{symbol: i for i, symbol in enumerate(alphabet)},
             **{token: 256 + i for i, token in enumerate(SPECIAL_TOKENS)}}
    backend = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    backend.decoder = decoders.ByteLevel()
    pad, bos, eos = SPECIAL_TOKENS
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token=pad, bos_token=bos, eos_token=eos)
