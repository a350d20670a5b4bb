"""streambp through the own decoder layers of DeepSeek Sparse Attention families (GLM-5's `glm_moe_dsa`,
DeepSeek-V3.2's `deepseek_v32`): multi-head latent attention restricted to the top-k keys a no-grad indexer
picks per query. Every parameter's gradient equals plain's in float64 (batch 2, left and right padding,
T not a multiple of the partition), the indexer's weights get none in either, GLM-5's shared layers reuse
the pick of the layer before; plain, checkpoint and mst simulate on the meta device. DeepSeek-V4 (compressed
sparse attention): `tests/unit/test_streambp_compressed_attention_own_layers.py`."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import StepSpec
from streambp_core.engine.own.arguments import key_indices_rows
from streambp_core.models.load import build_model
from streambp_core.step.simulation.simulate import simulate
from tests.unit.test_exactness import assert_padded_rows_match_plain, batch, relative_errors, step
from tests.unit.test_streambp_own_layers import config_dir

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition (8)."""
INDEX_TOPK = 4
"""Keys the indexer keeps per query: fewer than most queries see, so the pick shapes the attention."""
DSA = {
    "glm_moe_dsa": {"indexer_types": ["full", "shared"], "mlp_layer_types": ["dense", "sparse"]},
    "deepseek_v32": {"mlp_layer_types": ["dense", "sparse"]},
}
"""Each family's tiny config beyond `config_dir`'s: GLM-5's second layer reuses the first's pick; a routed
MoE layer after a dense one."""


def dsa_dir(tmp_path, family: str, **overrides) -> str:
    """A tiny config of `family` with a small indexer (4 heads of 16) keeping `INDEX_TOPK` keys; MLA's key
    heads are its query heads (4)."""
    values = {"index_topk": INDEX_TOPK, "index_head_dim": 16, "index_n_heads": 4, "num_key_value_heads": 4,
              "n_group": 1, "topk_group": 1}
    return config_dir(tmp_path, family, **values | DSA[family] | overrides)


@pytest.mark.parametrize("family", list(DSA))
@pytest.mark.parametrize("padding", ["right", "left"])
def test_streambp_through_sparse_attention_layers_matches_plain(tmp_path, family, padding):
    """Both give no gradient to the same parameters: the indexer's weights, and nothing else."""
    model = build_model(dsa_dir(tmp_path, family), dtype=torch.float64, seed=0)
    assert_padded_rows_match_plain(model, padding, SEQ_LEN)
    without = {name for name, param in model.named_parameters() if param.grad is None}
    assert without and all(".indexer." in name for name in without)


def test_an_unpadded_batch_under_the_engine_attention_choice_keeps_the_models_own_attention(tmp_path):
    """`baseline_attention="engine"` (what a CLI step resolves "auto" to) leaves the indexed layers their
    own attention, as plain does: the engine kernel takes no pick, and without padding it hands the layers
    no mask, which the indexer reads (GLM-5's indexer failed on `attention_mask[:, 0]` of None)."""
    torch.manual_seed(0)
    model = build_model(dsa_dir(tmp_path, "glm_moe_dsa"), dtype=torch.float64, seed=0)
    ids = batch(model.config.vocab_size, 1, SEQ_LEN, "right")[0]
    plain_loss, plain = step(model, "plain", ids, None, baseline_attention="engine")
    loss, grads = step(model, "streambp", ids, None, partition_size=8, head_partition_size=8,
                       baseline_attention="engine")
    assert abs(loss - plain_loss) <= 1e-12 * abs(plain_loss)
    errors = relative_errors(grads, plain)
    assert max(errors.values()) <= 1e-12, max(errors.items(), key=lambda item: item[1])


def test_the_indexer_pick_shapes_the_loss(tmp_path):
    """The tests' configs are not vacuous: keeping every key changes the loss."""
    ids, mask = batch(512, 2, SEQ_LEN, "right")
    losses = []
    for topk in (INDEX_TOPK, SEQ_LEN):
        directory = dsa_dir(tmp_path / str(topk), "glm_moe_dsa", index_topk=topk)
        model = build_model(directory, dtype=torch.float64, seed=0)
        losses.append(step(model, "plain", ids, mask)[0])
    assert abs(losses[0] - losses[1]) > 1e-6


def test_a_pick_past_the_chunks_keys_becomes_the_querys_own_position():
    """Rows 2..4 of a (1, 5, 3) pick against keys 0..3: indices 4 and 3 (masked keys the top-k took once
    the query's own were taken) turn into each row's own position; the rest are kept."""
    pick = torch.tensor([[[0, 1, 2], [1, 0, 2], [2, 1, 4], [3, 0, 4], [4, 3, 0]]])
    rows = key_indices_rows(pick, 2, 4)
    assert rows.tolist() == [[[2, 1, 2], [3, 0, 3]]]


@pytest.mark.parametrize("method", ["plain", "checkpoint", "mst"])
def test_the_baselines_simulate_on_the_meta_device(tmp_path, method):
    """They keep the model's own attention (the engine kernel takes no per-query pick), given an all-ones
    mask where the batch has none (transformers would read the positions' values to find packed rows)."""
    result = simulate(StepSpec.of(model=dsa_dir(tmp_path, "glm_moe_dsa"), method=method, seq_len_tokens=64))
    assert result.peak_bytes > 0
