"""The package's byte tokenizer (`streambp_core.models.byte_tokenizer`): any UTF-8 text, offline."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError
from streambp_core.models.byte_tokenizer import BYTE_VOCAB_SIZE, byte_tokenizer


def test_every_byte_is_one_id_below_256_and_text_comes_back() -> None:
    tokenizer = byte_tokenizer(512)
    text = "héllo wörld\t日本語\n  spaces "
    ids = tokenizer(text).input_ids
    assert len(ids) == len(text.encode("utf-8")) and max(ids) < 256
    assert tokenizer.decode(ids) == text
    assert (tokenizer.pad_token_id, tokenizer.bos_token_id, tokenizer.eos_token_id) == (256, 257, 258)
    assert len(tokenizer) == BYTE_VOCAB_SIZE


def test_a_vocabulary_too_small_for_it_is_refused() -> None:
    with pytest.raises(ConfigError, match="at least 259 tokens, the model has 100"):
        byte_tokenizer(100)
