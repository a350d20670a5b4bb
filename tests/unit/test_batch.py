"""Random batches: padding amounts, sides, labels, determinism."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.step.parts.batch import IGNORE_INDEX, padding_lengths, random_batch


def test_no_padding_has_no_mask_and_labels_equal_ids():
    batch = random_batch(vocab_size=50, seq_len=10, batch_size=2)
    assert batch.attention_mask is None
    assert torch.equal(batch.labels, batch.input_ids)
    assert batch.valid_tokens == 20


def test_rows_get_different_padding_around_a_fifth_on_average():
    lengths = padding_lengths(100, 3)
    assert lengths == sorted(lengths) and len(set(lengths)) == 3
    assert sum(lengths) / (3 * 100) == pytest.approx(0.2, abs=0.01)


def test_every_row_keeps_two_real_tokens():
    assert padding_lengths(2, 1) == [0]
    assert max(padding_lengths(3, 4)) == 1


@pytest.mark.parametrize("side", ["right", "left"])
def test_padding_side_masks_and_ignores_the_padded_positions(side):
    batch = random_batch(vocab_size=50, seq_len=20, batch_size=2, padding=side, seed=3)
    mask = batch.attention_mask
    pads = (mask == 0).sum(dim=1).tolist()
    assert pads == padding_lengths(20, 2)
    padded_column = -1 if side == "right" else 0
    assert (mask[:, padded_column] == 0).all()
    assert ((batch.labels == IGNORE_INDEX) == (mask == 0)).all()
    assert torch.equal(batch.labels[mask == 1], batch.input_ids[mask == 1])


def test_same_seed_same_batch():
    first = random_batch(vocab_size=50, seq_len=8, batch_size=2, padding="left", seed=7)
    again = random_batch(vocab_size=50, seq_len=8, batch_size=2, padding="left", seed=7)
    assert torch.equal(first.input_ids, again.input_ids)


def test_unknown_padding_is_a_config_error():
    with pytest.raises(ConfigError, match="padding"):
        random_batch(vocab_size=50, seq_len=8, batch_size=1, padding="middle")
