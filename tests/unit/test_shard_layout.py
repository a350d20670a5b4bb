"""One rank of N under FSDP2 from a single-rank breakdown: the shards follow FSDP2's layout (dim 0 padded
to a multiple of N), activations stay, and zero3 holds fewer gathered weights than zero2."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import ConfigError
from streambp_core.models import build_model, load_config
from streambp_core.step.parts.shards import ShardLayout, sharded_breakdown

GIB = 2**30


@pytest.fixture(scope="module")
def meta_model():
    config = load_config("tiny/qwen3")
    config.num_hidden_layers = 4  # more layers than zero3 gathers at once
    if isinstance(getattr(config, "layer_types", None), list):
        config.layer_types = config.layer_types[:1] * 4
    return build_model(config, dtype=torch.bfloat16, device="meta", seed=0)


def test_one_rank_holds_everything(meta_model):
    layout = ShardLayout.from_model(meta_model, 1)
    full = sum(p.numel() * p.element_size() for p in meta_model.parameters())
    assert layout.total("shard") == layout.total("full") == full
    assert len(layout.units) == meta_model.config.num_hidden_layers + 1


@pytest.mark.parametrize("gpus", [2, 3, 7])
def test_shards_are_dim0_padded_to_the_ranks(meta_model, gpus):
    layout = ShardLayout.from_model(meta_model, gpus)
    expected = sum(-(-p.shape[0] // gpus) * (p.numel() // p.shape[0]) * p.element_size()
                   for p in meta_model.parameters())
    assert layout.total("shard") == expected
    assert layout.total("full") <= gpus * layout.total("shard") < layout.total("full") * 1.1


def test_sharding_moves_state_not_activations(meta_model):
    layout = ShardLayout.from_model(meta_model, 4)
    full = layout.total("full")
    single = {"weights": full, "grads": full, "optimizer": 2 * full, "checkpoints": 5 * GIB, "kv": GIB,
              "logits": 3 * GIB, "temporaries": GIB}
    zero2, zero3 = (sharded_breakdown(single, layout, stage) for stage in ("zero2", "zero3"))
    for category in ("checkpoints", "kv", "logits", "temporaries"):
        assert zero2[category] == zero3[category] == single[category]
    assert zero2["weights"] == layout.total("shard") + full
    assert layout.total("shard") < zero3["weights"] < zero2["weights"]
    assert zero2["optimizer"] == pytest.approx(2 * layout.total("shard"), abs=1)
    assert zero2["grads"] == layout.total("shard") + layout.inflight_grad_bytes()


def test_the_optimizer_phase_holds_shards_only(meta_model):
    layout = ShardLayout.from_model(meta_model, 4)
    full = layout.total("full")
    rank = sharded_breakdown({"weights": full, "grads": full, "optimizer": 2 * full}, layout, "zero2",
                             phase="optimizer")
    assert rank["weights"] == rank["grads"] == layout.total("shard")


def test_forward_holds_no_gradients_in_flight_and_zero2_the_last_all_gather(meta_model):
    """In forward no unsharded gradient exists yet (resident ones are shards); zero2 also holds the flat
    all-gather output of the last layer gathered, freed only when the root's forward returns."""
    layout = ShardLayout.from_model(meta_model, 4)
    full = layout.total("full")
    single = {"weights": full, "grads": full, "logits": GIB}
    zero2, zero3 = (sharded_breakdown(single, layout, stage, phase="forward") for stage in ("zero2", "zero3"))
    assert zero2["grads"] == zero3["grads"] == layout.total("shard")
    layer = max(unit.shard * 4 for unit in layout.units[1:])
    assert zero2["weights"] == layout.total("shard") + full + layer
    assert zero3["weights"] == layout.total("shard") + layout.gathered_bytes("zero3")


def test_gradients_in_flight_are_at_most_the_gradients_there_are(meta_model):
    """Fresh gradients early in backward (the head's only): in flight are those, not root + two layers."""
    layout = ShardLayout.from_model(meta_model, 4)
    head = layout.units[0].trainable_full
    assert head < layout.inflight_grad_bytes()
    rank = sharded_breakdown({"weights": layout.total("full"), "grads": head}, layout, "zero2")
    assert rank["grads"] == round(head * layout.trainable_fraction) + head


def test_no_gradients_at_the_peak_means_none_in_flight(meta_model):
    layout = ShardLayout.from_model(meta_model, 4)
    assert sharded_breakdown({"weights": 1, "grads": 0}, layout, "zero3")["grads"] == 0


def test_bad_stage_and_rank_count_are_refused(meta_model):
    with pytest.raises(ConfigError, match="shard must be one of"):
        sharded_breakdown({}, ShardLayout.from_model(meta_model, 2), "zero1")
    with pytest.raises(ConfigError, match="gpus must be a positive integer"):
        ShardLayout.from_model(meta_model, 0)
