"""streambp on Gemma 4 (`gemma4_text`) through its own decoder layers gives plain's gradients in float64 for
every parameter: K = V in full layers, a weightless V norm, head dims 16/32 by layer type, proportional
partial RoPE, a MoE block beside the dense MLP, the layer scalar and the final soft-cap (the logits taken
whole); the E-series' per-layer inputs (their gradient returned to the per-layer embedding) and keys and
values shared across layers (a consumer's K/V gradient handed to the layer that stored them). Batch 2,
left and right padding, T 37 against chunks of 8."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from streambp_core.models.load import build_model
from tests.unit.test_causal_lm_families import SIZES, tiny_values
from tests.unit.test_exactness import assert_padded_rows_match_plain, batch, relative_errors, step

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition (8)."""
SLIDING, FULL = "sliding_attention", "full_attention"
COMMON = {"num_hidden_layers": 4, "layer_types": [SLIDING, FULL] * 2, "sliding_window": 8,
          "global_head_dim": 32, "hidden_size_per_layer_input": 0, "vocab_size_per_layer_input": 512,
          "final_logit_softcapping": 30.0}
"""Every tiny Gemma 4: windows shorter than the sequence, full layers' heads twice the sliding ones',
the final soft-cap of the released models."""
CONFIGS = {
    "dense": {"attention_k_eq_v": True, "num_global_key_value_heads": 1},
    "moe": {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "enable_moe_block": True,
            "top_k_experts": 2},
    "e-series": {"num_hidden_layers": 5, "layer_types": [SLIDING, FULL, SLIDING, SLIDING, FULL],
                 "hidden_size_per_layer_input": 16, "num_kv_shared_layers": 2, "use_double_wide_mlp": True},
}
"""The shapes of 31B (dense, K = V in full layers), 26B-A4B (a MoE block beside the MLP) and E2B/E4B
(per-layer inputs; the last two layers attend to the K/V of the last earlier layer of their type)."""


def gemma4_dir(tmp_path: Path, shape: str) -> str:
    """A directory holding a tiny gemma4_text config.json of `shape` (`CONFIGS`)."""
    values = tiny_values("gemma4_text", SIZES) | COMMON | CONFIGS[shape]
    values.pop("per_layer_config")  # rebuilt from global_head_dim and num_global_key_value_heads
    directory = tmp_path / shape
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(values))
    return str(directory)


@pytest.mark.parametrize("shape", list(CONFIGS))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_streambp_on_gemma4_matches_plain(tmp_path, shape, padding):
    model = build_model(gemma4_dir(tmp_path, shape), dtype=torch.float64, seed=0)
    assert_padded_rows_match_plain(model, padding, SEQ_LEN, methods=("checkpoint", "streambp"))


def test_the_e_series_config_shares_keys_and_values_and_feeds_per_layer_inputs(tmp_path):
    """The E-series shape exercises what it is named for: two consumers, each of a store of its type, and
    a per-layer embedding whose gradient comes only through the layers' per-layer inputs."""
    model = build_model(gemma4_dir(tmp_path, "e-series"), dtype=torch.float64, seed=0)
    assert model.config.kv_sharing_modes == [None, "store", "store", "reuse", "reuse"]
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "right")
    _, grads = step(model, "streambp", ids, mask, partition_size=8, head_partition_size=8)
    assert grads["model.embed_tokens_per_layer.weight"].norm() > 0
    assert "model.layers.3.self_attn.k_proj.weight" not in grads


def _gradients(model, method: str, ids, mask) -> dict[str, torch.Tensor]:
    """Every trainable parameter's gradient after one step of `method` (chunks of 8)."""
    return step(model, method, ids, mask, partition_size=8, head_partition_size=8)[1]


def test_a_store_gets_its_consumers_key_and_value_gradient(tmp_path):
    """The consumers' K/V gradient is a visible part of a store's: plain with the hand-over cut (the
    consumer of layer 2 attends to detached K/V) moves layer 2's K projection gradient, which streambp
    matches to plain's."""
    model = build_model(gemma4_dir(tmp_path, "e-series"), dtype=torch.float64, seed=0)
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "left")
    plain = _gradients(model, "plain", ids, mask)
    streamed = _gradients(model, "streambp", ids, mask)
    consumer = model.model.layers[3].self_attn
    forward = type(consumer).forward

    def detached(self, *args, shared_kv_states, **kwargs):
        kept = {key: tuple(t.detach() for t in kv) for key, kv in shared_kv_states.items()}
        return forward(self, *args, shared_kv_states=kept, **kwargs)

    consumer.forward = detached.__get__(consumer)
    try:
        cut = _gradients(model, "plain", ids, mask)
    finally:
        del consumer.forward
    name = "model.layers.2.self_attn.k_proj.weight"
    assert relative_errors(cut, plain)[name] > 1e-3
    assert relative_errors(streamed, plain)[name] <= 1e-12


def test_a_frozen_per_layer_input_is_cut_per_chunk(tmp_path):
    """With the embeddings frozen the per-layer inputs need no gradient: they are cut per chunk as the hidden
    states are, and the layers' gradients match plain's."""
    model = build_model(gemma4_dir(tmp_path, "e-series"), dtype=torch.float64, seed=0)
    for name, param in model.model.named_parameters():
        param.requires_grad_(name.startswith("layers."))
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "right")
    errors = relative_errors(_gradients(model, "streambp", ids, mask), _gradients(model, "plain", ids, mask))
    assert errors and max(errors.values()) <= 1e-12
