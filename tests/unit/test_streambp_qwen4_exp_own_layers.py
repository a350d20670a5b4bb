"""streambp on Qwen4-Exp (`qwen4_exp_text`) through its own decoder layers: its Gated DeltaNet layers (state
and conv halo carried across chunks, the padding mask read as `conv_mask`), hyper-connection residuals and
MoE give plain's gradients in float64 for every parameter, batch 2, left and right padding, T not a
multiple of the partition; its QSA attention layers are refused by name, before a step and when prepared."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.methods.guards import family_refusals
from streambp_core.models.load import build_model, load_config
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_matches_plain, batch

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition (8)."""
QSA = {"layer_types": ["linear_attention", "indexed_attention"], "indexer_n_heads": 2, "indexer_kv_heads": 1,
       "indexer_head_dim": 16, "indexer_budget": 8, "indexer_compress_ratio": 4}
"""A linear layer, then an attention layer with its QSA indexer (every Qwen4-Exp attention layer has one)."""


def config_dir(tmp_path: Path, **overrides) -> str:
    """A directory holding a tiny qwen4_exp_text config.json with `overrides` (the tiny defaults: two Gated
    DeltaNet layers)."""
    directory = tmp_path / "qwen4_exp_text"
    directory.mkdir(parents=True, exist_ok=True)
    values = tiny_values("qwen4_exp_text", SIZES) | overrides
    (directory / "config.json").write_text(json.dumps(values, default=str))
    return str(directory)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_streambp_through_the_linear_layers_matches_plain(tmp_path, padding):
    torch.manual_seed(0)
    model = build_model(config_dir(tmp_path), dtype=torch.float64, seed=0)
    assert model.config.layer_types == ["linear_attention", "linear_attention"]
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, padding)
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=8, head_partition_size=8)


def test_the_qsa_layers_are_refused_by_name(tmp_path):
    directory = config_dir(tmp_path, **QSA)
    reason = "which do not carry Qwen4-Exp's QSA attention"
    assert reason in family_refusals(load_config(directory))["streambp"]
    model = build_model(directory, dtype=torch.float64, seed=0)
    with pytest.raises(ConfigError, match=reason):
        streambp_core.prepare(model, "streambp")
