"""The sharded simulator (`StepSpec.gpus`/`shard`): one rank of N, laid out from a single-GPU step.

At one GPU a stage holds what one GPU holds plus exactly what the engine adds (FSDP2: the gathered units
and the unsharded gradients in flight; DeepSpeed ZeRO-2: fp32 master weights and moments, its gradient
partition and bucket), activations unchanged; across GPUs the sharded state shrinks as 1/N (plus FSDP2's
dim-0 padding) while the activations stay."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streambp_core.config import ConfigError, StepSpec
from streambp_core.models import load_config
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.parts.shards import (
    DEEPSPEED_PREFETCH_ELEMENTS,
    DEEPSPEED_REDUCE_BUCKET_ELEMENTS,
    ShardLayout,
)
from streambp_core.step.run.setup import build_training_model, resident_bytes
from streambp_core.step.simulation.simulate import shard_layout, simulate

MODEL = "tiny/qwen3"
ACTIVATIONS = ("checkpoints", "kv", "logits", "temporaries")


@pytest.fixture(scope="module")
def sim():
    """simulate(spec) sharing one memo across the module's steps."""
    model = ResolvedModel(load_config(MODEL))
    return lambda spec, model_config=model: simulate(spec, model_config)


def _spec(**fields) -> StepSpec:
    base = {"model": MODEL, "method": "streambp", "seq_len_tokens": 128, "partition_size": 32,
            "head_partition_size": 16, "dtype": "bfloat16"}
    return StepSpec.of(**{**base, **fields})


def test_bad_gpus_and_shard_are_refused():
    with pytest.raises(ConfigError, match="gpus must be a positive integer"):
        _spec(gpus=0)
    with pytest.raises(ConfigError, match="shard must be one of"):
        _spec(gpus=2, shard="zero1")
    with pytest.raises(ConfigError, match="gpus 4 needs a shard stage"):
        _spec(gpus=4)
    assert _spec(gpus=1, shard="zero2").shard == "zero2"  # one FSDP rank


@pytest.mark.parametrize("stage", ["zero2", "zero3"])
def test_one_rank_of_one_is_the_single_gpu_step_plus_what_fsdp_adds(sim, stage):
    single = sim(_spec())
    rank = sim(_spec(gpus=1, shard=stage))
    layout = shard_layout(rank.spec, load_config(MODEL))
    for category in ACTIVATIONS + ("optimizer",):
        assert rank.breakdown_bytes[category] == single.breakdown_bytes[category], category
    assert rank.breakdown_bytes["weights"] == single.breakdown_bytes["weights"] + layout.gathered_bytes(stage)
    assert rank.breakdown_bytes["grads"] == single.breakdown_bytes["grads"] + layout.inflight_grad_bytes()
    assert "one rank of 1, " + stage in rank.how


def test_deepspeed_one_rank_holds_fp32_master_and_moments(sim):
    spec = _spec(optimizer="adamw", gpus=1, shard="deepspeed-zero2")
    single = sim(_spec(optimizer="adamw"))
    rank = sim(spec)
    layout = shard_layout(spec, load_config(MODEL))
    assert rank.breakdown_bytes["weights"] == single.breakdown_bytes["weights"] >= layout.total("full")
    assert rank.breakdown_bytes["optimizer"] == 12 * layout.trainable_numel  # fp32 master, m and v
    bucket = 2 * min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, layout.trainable_numel)
    assert rank.breakdown_bytes["grads"] >= 2 * layout.trainable_numel + bucket


@pytest.mark.parametrize("stage", ["zero3", "deepspeed-zero2", "deepspeed-zero3"])
def test_sharded_state_shrinks_as_one_over_n_and_activations_stay(sim, stage):
    ranks = {n: sim(_spec(optimizer="adamw", gpus=n, shard=stage)) for n in (2, 4, 8)}
    for n, rank in ranks.items():
        for category in ACTIVATIONS[:-1]:
            assert rank.breakdown_bytes[category] == ranks[2].breakdown_bytes[category]
        state, two = rank.breakdown_bytes["optimizer"] * n, ranks[2].breakdown_bytes["optimizer"] * 2
        assert two <= state <= two * 1.15
    peaks = [ranks[n].peak_bytes for n in (2, 4, 8)]
    assert peaks[0] > peaks[1] > peaks[2]


def test_zero3_holds_less_than_zero2_and_deepspeed_more_on_a_big_model(sim):
    config = load_config("Qwen/Qwen3-8B")
    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="checkpoint", seq_len_tokens=1024, optimizer="adamw")
    peaks = {stage: sim(replace(spec, gpus=8, shard=stage), config)
             for stage in ("zero2", "zero3", "deepspeed-zero2")}
    model, _ = build_training_model(spec, config, "meta")
    layout = ShardLayout.from_model(model, 8)
    assert peaks["zero3"].peak_bytes < peaks["zero2"].peak_bytes < peaks["deepspeed-zero2"].peak_bytes
    moments = 2 * layout.total("trainable_shard")  # pure-bf16 AdamW: two bf16 moments per shard element
    assert peaks["zero2"].breakdown_bytes["optimizer"] == pytest.approx(moments, abs=8)
    assert peaks["deepspeed-zero2"].breakdown_bytes["optimizer"] == 12 * layout.partition_numel


def test_deepspeed_zero3_partitions_the_weights_and_keeps_zero2s_fp32_state(sim):
    """DeepSpeed ZeRO-3 on 8 GPUs: the bf16 weights partitioned (its shards, the root and one layer
    gathered with the prefetch, the small persistent parameters whole), the same fp32 master weights and
    moments as ZeRO-2, the gradient partition and bucket in every phase."""
    config = load_config("Qwen/Qwen3-8B")
    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="streambp", seq_len_tokens=1024, optimizer="adamw")
    two, three = (sim(replace(spec, gpus=8, shard=stage), config) for stage in ("deepspeed-zero2",
                                                                                "deepspeed-zero3"))
    model, _ = build_training_model(spec, config, "meta")
    layout = ShardLayout.from_model(model, 8)
    layer = max(unit.full for unit in layout.units[1:])
    gathered = layout.units[0].full + layer + min(2 * DEEPSPEED_PREFETCH_ELEMENTS, layer)
    buffers = three.breakdown_bytes["weights"] - (layout.total("shard") + layout.persistent_bytes + gathered)
    assert 0 <= buffers < 2**20  # the rotary tables: buffers are not partitioned
    assert three.breakdown_bytes["weights"] < two.breakdown_bytes["weights"] / 2
    state = 12 * layout.partition_numel
    assert three.breakdown_bytes["optimizer"] == two.breakdown_bytes["optimizer"] == state
    bucket = 2 * min(DEEPSPEED_REDUCE_BUCKET_ELEMENTS, layout.trainable_numel)
    assert three.breakdown_bytes["grads"] >= 2 * layout.partition_numel + bucket
    assert three.peak_bytes < two.peak_bytes


def test_resident_bytes_are_one_ranks():
    config = load_config(MODEL)
    whole = resident_bytes(_spec(optimizer="adamw"), config)
    shards = resident_bytes(_spec(optimizer="adamw", gpus=4, shard="zero3"), config)
    assert whole / 4 <= shards <= whole / 4 * 1.2


def test_a_sharded_step_is_not_measured_as_one_unsharded_gpu():
    from streambp_core.step.search.probe import max_len

    with pytest.raises(ConfigError, match="simulated only"):
        max_len(_spec(gpus=2, shard="zero2"), 2**30, "cpu")
