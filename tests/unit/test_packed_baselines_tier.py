"""Packed rows on families of the baselines tier (transformers' own forward, no engine adapter): plain and
checkpoint run them, each document unseen by the others (the same gradients as each document in its own
row); a model that cannot keep a row's documents apart, and streambp through a model's own layers, are
refused by name."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.models.load import build_model
from tests.unit.test_causal_lm_families import family_dir
from tests.unit.test_packed import DOCS, assert_close, packed_batch, step
from tests.unit.test_streambp_own_layers import config_dir

ROWS = [list(DOCS), [9, 6]]
"""Row 0 packs DOCS (23 tokens), row 1 two documents and 8 padding tokens."""


def _one_row_per_document(ids):
    """Each document of `ROWS` alone in a right-padded row: ids and mask."""
    docs = [(row, sum(lengths[:i]), n) for row, lengths in enumerate(ROWS) for i, n in enumerate(lengths)]
    alone = torch.zeros(len(docs), max(DOCS), dtype=torch.long)
    mask = torch.zeros_like(alone)
    for i, (row, start, n) in enumerate(docs):
        alone[i, :n], mask[i, :n] = ids[row, start:start + n], 1
    return alone, mask


@pytest.mark.parametrize("family", ["ministral3", "minimax_m2"])
def test_plain_and_checkpoint_keep_a_rows_documents_apart(tmp_path, family):
    """ministral3 with an 8-token window, minimax_m2 with its experts."""
    model = build_model(config_dir(tmp_path, family), dtype=torch.float64, seed=0)
    ids, mask, positions = packed_batch(model.config.vocab_size, ROWS, sum(DOCS))
    packed = step(model, "plain", ids, mask, positions)
    alone, alone_mask = _one_row_per_document(ids)
    assert_close(step(model, "plain", alone, alone_mask, None), packed, "one row per document")
    assert_close(step(model, "checkpoint", ids, mask, positions), packed, "checkpoint")


@pytest.mark.parametrize(("family", "cause"), [
    ("jamba", "architecture 'jamba': its 'linear_attention' layers carry state across a row's documents"),
    ("bloom", "architecture 'bloom': its forward takes no position_ids"),
])
def test_a_model_that_cannot_keep_documents_apart_is_refused_by_name(tmp_path, family, cause):
    model = build_model(family_dir(tmp_path, family), dtype=torch.float64, seed=0)
    ids, mask, positions = packed_batch(model.config.vocab_size, ROWS, sum(DOCS))
    for method in ("plain", "checkpoint"):
        with pytest.raises(ConfigError, match=rf"packed rows .* not supported for {cause}"):
            step(model, method, ids, mask, positions)


def test_streambp_through_a_models_own_layers_refuses_packed_rows(tmp_path):
    model = build_model(config_dir(tmp_path, "ministral3"), dtype=torch.float64, seed=0)
    ids, mask, positions = packed_batch(model.config.vocab_size, ROWS, sum(DOCS))
    with pytest.raises(ConfigError, match="streambp: packed rows .* through a model's own decoder layers"):
        step(model, "streambp", ids, mask, positions)
