"""streambp through LFM2's own decoder layers carries its short conv's halo (the kernel - 1 conv inputs
before a chunk; the mixer has no recurrent state) across chunk boundaries (`engine.own.recurrent`): LFM2
(gated short-conv and attention layers) and LFM2-MoE give plain's gradients in float64 for every parameter,
batch 2, left and right padding, T not a multiple of the partition, chunks no longer than the halo, a
trailing one-token chunk."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streambp_core.models.load import build_model
from tests.model_dirs import config_directory
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_padded_rows_match_plain
from tests.unit.test_streambp_mamba2_own_layers import assert_uncarried_is_off

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partitions used."""
LAYERS = {"num_hidden_layers": 3, "layer_types": ["conv", "full_attention", "conv"]}
"""Short-conv layers before and after an attention layer (the tiny defaults are attention alone)."""


def model_of(tmp_path: Path, family: str):
    """A float64 `family` model with random weights, built from a tiny config.json (`LAYERS`)."""
    values = tiny_values(family, SIZES) | LAYERS
    return build_model(config_directory(tmp_path, family, values), dtype=torch.float64, seed=0)


def test_the_tiny_model_has_short_conv_layers(tmp_path):
    model = model_of(tmp_path, "lfm2")
    assert [hasattr(layer, "conv") for layer in model.model.layers] == [True, False, True]
    assert model.model.layers[0].conv.conv_kernel_size == 3


@pytest.mark.parametrize(("family", "padding"), [("lfm2", "right"), ("lfm2", "left"), ("lfm2_moe", "left")])
def test_streambp_carries_the_short_conv_halo_across_chunks(tmp_path, family, padding):
    assert_padded_rows_match_plain(model_of(tmp_path, family), padding, SEQ_LEN)


@pytest.mark.parametrize(("seq_len", "partition_size"), [(21, 2), (33, 8)])
def test_chunks_as_short_as_the_halo_and_a_trailing_one_token_chunk_match_plain(tmp_path, seq_len,
                                                                                 partition_size):
    """Chunks of 2 tokens hand on a halo (2 conv inputs) that is the whole chunk before; at 33 tokens the
    last chunk of 1 token joins the one before it."""
    assert_padded_rows_match_plain(model_of(tmp_path, "lfm2"), "left", seq_len, partition_size=partition_size)


def test_the_carried_halo_is_what_changes_the_gradient(tmp_path, monkeypatch):
    """Backward with each chunk's conv from zeros is not plain's: the halo is what the exactness above
    rests on."""
    torch.manual_seed(0)
    assert_uncarried_is_off(model_of(tmp_path, "lfm2"), "model.layers.0.conv.conv.weight", monkeypatch)
