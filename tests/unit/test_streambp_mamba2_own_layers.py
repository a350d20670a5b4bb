"""streambp through a hybrid's own decoder layers carries each Mamba2 (SSD) mixer's state and conv halo
across chunk boundaries (`engine.own.recurrent`): Nemotron-H (Mamba2, NoPE attention, relu² MLP and MoE
blocks) and Granite 4.0 (Mamba2 or attention, then MoE) give plain's gradients in float64 for every
parameter, batch 2, left and right padding, T not a multiple of the partition, chunks shorter than the conv's
halo, a trailing one-token chunk; Bamba (layers returning (hidden states, None)) and Falcon-H1 (Mamba2 and
attention side by side in one layer) likewise."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from streambp_core.models.load import build_model
from tests.model_dirs import config_directory
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_padded_rows_match_plain, batch, step

MAMBA = {"nemotron_h": {"mamba_num_heads": 8, "mamba_head_dim": 8, "ssm_state_size": 16, "n_groups": 2,
                        "chunk_size": 16, "moe_shared_expert_intermediate_size": 32},
         "granitemoehybrid": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16,
                              "mamba_n_groups": 2, "mamba_chunk_size": 16, "shared_intermediate_size": 32,
                              "num_hidden_layers": 3,
                              "layer_types": ["mamba", "attention", "mamba"]},
         "bamba": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_state": 16, "mamba_n_groups": 2,
                   "mamba_chunk_size": 16, "attn_layer_indices": [1], "num_hidden_layers": 3},
         "falcon_h1": {"mamba_n_heads": 8, "mamba_d_head": 16, "mamba_d_ssm": 128, "mamba_d_state": 16,
                       "mamba_n_groups": 2, "mamba_chunk_size": 16}}
"""Each family's tiny Mamba2 sizes beyond `tiny_values`: 8 heads, state 16, 2 groups, the SSD's own chunk
(16) neither the partition nor the sequence. Nemotron-H's default pattern is one block of each type (Mamba2,
MoE, attention, MLP)."""
SEQ_LEN = 37
"""Tokens per row: not a multiple of the partitions used."""


def model_of(tmp_path: Path, family: str):
    """A float64 model of `family` with random weights, built from a tiny config.json (`MAMBA`)."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = CONFIG_MAPPING[family](**tiny_values(family, SIZES) | MAMBA[family]).to_dict()
    return build_model(config_directory(tmp_path, family, values), dtype=torch.float64, seed=0)


@pytest.mark.parametrize(("family", "padding"), [
    ("nemotron_h", "right"), ("nemotron_h", "left"), ("granitemoehybrid", "right"),
    pytest.param("granitemoehybrid", "left", marks=pytest.mark.slow)])
def test_streambp_carries_the_mamba2_state_across_chunks(tmp_path, family, padding):
    assert_padded_rows_match_plain(model_of(tmp_path, family), padding, SEQ_LEN)


@pytest.mark.parametrize(("seq_len", "partition_size"), [(21, 2), (33, 8)])
def test_short_chunks_and_a_trailing_one_token_chunk_match_plain(tmp_path, seq_len, partition_size):
    """Chunks of 2 tokens (21 tokens: 11 chunks) hand on a halo (3 conv inputs) that reaches into the chunk
    before; at 33 tokens the last chunk of 1 token joins the one before it."""
    model = model_of(tmp_path, "nemotron_h")
    assert_padded_rows_match_plain(model, "left", seq_len, partition_size=partition_size)


def test_the_streamed_state_is_what_changes_the_gradient(tmp_path, monkeypatch):
    """Backward without the carried state (each chunk from zeros) is not plain's: the carry is what the
    exactness above rests on."""
    torch.manual_seed(0)
    model = model_of(tmp_path, "nemotron_h")
    assert_uncarried_is_off(model, "model.layers.0.mixer.in_proj.weight", monkeypatch)


def assert_uncarried_is_off(model, name: str, monkeypatch) -> None:
    """streambp with every chunk boundary's carry dropped (each chunk's state and conv from zeros) puts
    `name`'s gradient more than 1e-3 (relative) from plain's."""
    from streambp_core.engine.own import recurrent

    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "right")
    _, ref = step(model, "plain", ids, mask)
    monkeypatch.setattr(recurrent, "_boundaries", lambda call, hidden, bounds, implementation:
                        [(None, None)] * len(bounds))
    _, grads = step(model, "streambp", ids, mask, partition_size=8, head_partition_size=8)
    assert (grads[name] - ref[name]).norm() > 1e-3 * ref[name].norm()


@pytest.mark.slow
def test_a_users_from_config_nemotron_h_matches_plain(tmp_path):
    """Built by transformers alone: the run widens the float32 islands (SSD scan, norms, router logits);
    the router weight transformers keeps in float32 has a float32 sum for its gradient (float32's bound),
    every float64 parameter is within 1e-12."""
    from transformers import AutoModelForCausalLM

    from tests.unit.test_exactness import relative_errors

    config = model_of(tmp_path, "nemotron_h").config
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa",
                                             experts_implementation="eager")
    ids, mask = batch(config.vocab_size, 2, SEQ_LEN, "left")
    _, ref = step(model, "plain", ids, mask)
    _, grads = step(model, "streambp", ids, mask, partition_size=5, head_partition_size=7)
    dtypes = dict((name, p.dtype) for name, p in model.named_parameters())
    for name, err in relative_errors(grads, ref).items():
        assert err <= (2e-5 if dtypes[name] == torch.float32 else 1e-12), f"{name} relative error {err:.2e}"


@pytest.mark.parametrize(("family", "padding"), [("bamba", "left"), ("falcon_h1", "right"),
                                                 pytest.param("bamba", "right", marks=pytest.mark.slow),
                                                 pytest.param("falcon_h1", "left", marks=pytest.mark.slow)])
def test_bamba_and_falcon_h1_match_plain(tmp_path, family, padding):
    """Bamba's layers return (hidden states, None) beside them under SDPA; Falcon-H1's run Mamba2 and
    attention side by side on one input (`engine.own.parallel`: each chunk against the prefix's keys and
    values and from the state and halo before it) and return a one-tuple."""
    assert_padded_rows_match_plain(model_of(tmp_path, family), padding, SEQ_LEN)


def test_falcon_h1_carries_keys_and_state_together(tmp_path, monkeypatch):
    """Without the carried state (each chunk from zeros) Falcon-H1's mixer is not plain's: both carries are
    what its exactness rests on."""
    from streambp_core.engine.own import parallel

    torch.manual_seed(0)
    model = model_of(tmp_path, "falcon_h1")
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "right")
    _, ref = step(model, "plain", ids, mask)
    forward_pass = parallel._forward_pass

    def stateless(*args):
        keys, values, boundaries = forward_pass(*args)
        return keys, values, [(None, None)] * len(boundaries)

    monkeypatch.setattr(parallel, "_forward_pass", stateless)
    _, grads = step(model, "streambp", ids, mask, partition_size=8, head_partition_size=8)
    mixer = "model.layers.0.mamba.in_proj.weight"
    assert (grads[mixer] - ref[mixer]).norm() > 1e-3 * ref[mixer].norm()

