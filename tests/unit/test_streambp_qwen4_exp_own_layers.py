"""streambp on Qwen4-Exp (`qwen4_exp_text`) through its own decoder layers: its Gated DeltaNet layers (state
and conv halo carried across chunks, the padding mask read as `conv_mask`), hyper-connection residuals and
MoE give plain's gradients in float64 for every parameter, batch 2, left and right padding, T not a
multiple of the partition; its QSA attention layers through their indexer's selection, recorded once per
layer (the indexer's weights get no gradient, as in plain); a PLE layer is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.load import build_model
from tests.model_dirs import config_directory
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_padded_rows_match_plain, batch, relative_errors, step

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition (8)."""
QSA = {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2, "indexer_kv_heads": 1,
       "indexer_head_dim": 16, "indexer_budget": 8, "indexer_compress_ratio": 4}
"""A linear layer, then an attention layer with its QSA indexer (every Qwen4-Exp attention layer has one)."""


def config_dir(tmp_path: Path, **overrides) -> str:
    """A directory holding a tiny qwen4_exp_text config.json with `overrides` (the tiny defaults: two Gated
    DeltaNet layers)."""
    return config_directory(tmp_path, "qwen4_exp_text", tiny_values("qwen4_exp_text", SIZES) | overrides)


@pytest.mark.parametrize("padding", ["right", pytest.param("left", marks=pytest.mark.slow)])
def test_streambp_through_the_linear_layers_matches_plain(tmp_path, padding):
    model = build_model(config_dir(tmp_path), dtype=torch.float64, seed=0)
    assert model.config.layer_types == ["linear_attention", "linear_attention"]
    assert_padded_rows_match_plain(model, padding, SEQ_LEN)


@pytest.mark.parametrize("padding", ["right", pytest.param("left", marks=pytest.mark.slow),
                                     pytest.param("none", marks=pytest.mark.slow)])
def test_streambp_through_the_qsa_layers_matches_plain(tmp_path, padding):
    """The QSA indexer's selection mask (B, 1, T, T) is recorded once per layer, before the keys it runs
    ahead of, and each chunk's attention takes its rows against the chunk's keys; without a padding mask
    (none: `conv_mask` is None) the linear layers still read theirs by that name."""
    torch.manual_seed(0)
    model = build_model(config_dir(tmp_path, **QSA), dtype=torch.float64, seed=0)
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, padding)
    mask = None if padding == "none" else mask
    plain_loss, plain = step(model, "plain", ids, mask)
    loss, grads = step(model, "streambp", ids, mask, partition_size=8, head_partition_size=8)
    assert abs(loss - plain_loss) <= 1e-12 * abs(plain_loss)
    assert grads.keys() == plain.keys()
    assert not any(".indexer." in name for name in plain)
    errors = relative_errors(grads, plain)
    assert max(errors.values()) <= 1e-12, max(errors.items(), key=lambda item: item[1])


def test_the_qsa_selection_shapes_the_loss(tmp_path):
    """The test's config is not vacuous: a budget of every key changes the loss."""
    ids, mask = batch(512, 2, SEQ_LEN, "right")
    losses = []
    for budget in (QSA["indexer_budget"], 4 * SEQ_LEN):
        model = build_model(config_dir(tmp_path / str(budget), **QSA | {"indexer_budget": budget}),
                            dtype=torch.float64, seed=0)
        losses.append(step(model, "plain", ids, mask)[0])
    assert abs(losses[0] - losses[1]) > 1e-6


def test_a_ple_layer_is_refused_by_name(tmp_path):
    """A PLE layer's per-layer embedding runs a second short conv beside its Gated DeltaNet's (conv state 1),
    which the stream does not carry (one conv state per layer)."""
    directory = config_dir(tmp_path, ple_layer_ids=[1], eos_token_id=2, ngram_vocab_size_base=1000,
                           split_ngram_parts=4)
    model = build_model(directory, dtype=torch.float64, seed=0)
    ids, mask = batch(model.config.vocab_size, 1, 12, "right")
    with pytest.raises(ConfigError, match="more than one conv or recurrent state per layer"), \
            streambp_core.prepare(model, "streambp", partition_size=4, head_partition_size=8) as run:
        run.loss(ids, attention_mask=mask)
