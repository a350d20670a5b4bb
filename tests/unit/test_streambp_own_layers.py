"""streambp by construction: families of the baselines tier streamed through their own decoder layers
(`engine.own`) give plain's gradients in float64 for every parameter (batch 2, left and right padding,
T not a multiple of the partition, GQA, MLA, sliding windows, mixtures of experts), built through
`build_model` and a user's `AutoModelForCausalLM.from_config`; between forward and backward each layer
keeps its input alone; what the path cannot carry is refused by name."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.models.catalogue import serving
from streambp_core.models.load import build_model
from tests.model_dirs import config_directory
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_matches_plain, assert_padded_rows_match_plain, batch

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition (8) nor of the head's."""
FAMILIES = {
    "ministral3": {"sliding_window": 8},
    "minimax_m2": {},
    "glm4_moe_lite": {"num_key_value_heads": 4},
    "cohere2": {"sliding_window": 8},
}
"""Families of the baselines tier and what their tiny configs set beyond `tiny_values`: windows shorter
than the sequence; MLA's key heads are its query heads (4), as in the released models."""


def config_dir(tmp_path: Path, model_type: str, **overrides) -> str:
    """A directory holding a tiny config.json of `model_type`, with `FAMILIES`' settings and `overrides`."""
    values = tiny_values(model_type, SIZES) | FAMILIES.get(model_type, {}) | overrides
    return config_directory(tmp_path, model_type, values)


def test_the_families_are_of_the_baselines_tier():
    assert all(serving(family).path == "baselines" for family in FAMILIES)


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_streambp_through_the_models_own_layers_matches_plain(tmp_path, family, padding):
    model = build_model(config_dir(tmp_path, family), dtype=torch.float64, seed=0)
    assert_padded_rows_match_plain(model, padding, SEQ_LEN)


@pytest.mark.parametrize("family", ["ministral3", "minimax_m2", "cohere2"])
def test_a_users_from_config_model_matches_plain(tmp_path, family):
    """Built by transformers alone (float32 islands widened by the run itself, `models.precision`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(config_dir(tmp_path, family))
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64, attn_implementation="sdpa",
                                             experts_implementation="eager")
    ids, mask = batch(config.vocab_size, 2, SEQ_LEN, "left")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=5, head_partition_size=7)


def test_eager_attention_and_the_fused_head_match_plain(tmp_path):
    """Eager attention gets its mask rows cut per chunk; the fused head streams over the stack's output."""
    model = build_model(config_dir(tmp_path, "ministral3"), dtype=torch.float64, seed=0,
                        attn_implementation="eager")
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=6, head_partition_size=16,
                         head_mode="fused")


def _kept_between_passes_bytes(model, ids) -> int:
    """Bytes streambp keeps alive from the end of the forward to the start of the backward."""
    with streambp_core.prepare(model, "streambp", partition_size=8, head_partition_size=8) as run, \
            MemoryTracker(model) as tracker:
        before = tracker.live_bytes
        loss = run.loss(ids)
        kept = tracker.live_bytes - before
        loss.backward()
    return kept


def test_each_layer_keeps_its_input_alone_between_forward_and_backward(tmp_path):
    """Two more layers keep two more layer inputs (B, T, d), and nothing of their insides (plain keeps
    the attention's and the MLP's activations: several times as much)."""
    bytes_per_input = 2 * 64 * 64 * 8  # B * T * d * float64
    kept = {}
    for layers in (2, 4):
        path = config_dir(tmp_path / str(layers), "ministral3", num_hidden_layers=layers,
                          intermediate_size=512)
        model = build_model(path, dtype=torch.float64, seed=0)
        ids = torch.randint(0, model.config.vocab_size, (2, 64))
        kept[layers] = _kept_between_passes_bytes(model, ids)
    assert (kept[4] - kept[2]) == 2 * bytes_per_input


def test_what_the_path_cannot_carry_is_refused_by_name(tmp_path):
    model = build_model(config_dir(tmp_path, "minimax_m2", output_router_logits=True), dtype=torch.float64)
    with pytest.raises(ConfigError, match="minimax_m2.*its own decoder layers.*router load-balancing loss"):
        streambp_core.prepare(model, "streambp")
    model = build_model(config_dir(tmp_path / "offload", "ministral3"), dtype=torch.float64)
    with pytest.raises(ConfigError, match="its own decoder layers.*offload tiers"):
        streambp_core.prepare(model, "streambp", offload="checkpoints")
    with streambp_core.prepare(model, "streambp") as run, \
            pytest.raises(ConfigError, match="hidden_states.*its own decoder layers"):
        run.hidden_states(torch.ones(1, 6, dtype=torch.long))


def test_the_layers_are_given_back_after_each_step(tmp_path):
    model = build_model(config_dir(tmp_path, "ministral3"), dtype=torch.float64)
    model.eval()
    before = [dict(vars(layer)) for layer in model.model.layers]
    with streambp_core.prepare(model, "streambp", partition_size=8) as run:
        run.loss(torch.ones(1, 12, dtype=torch.long)).backward()
        assert [dict(vars(layer)) for layer in model.model.layers] == before
