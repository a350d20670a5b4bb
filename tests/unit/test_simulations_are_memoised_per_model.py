"""A resolved model simulates each step once: `simulate` answers a spec it has seen from the model's memo,
and the shard stages of one step share its single-GPU simulation, with the figures a fresh model gives."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError, StepSpec
from streambp_core.models import load_config
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.simulation.simulate import simulate
from streambp_core.tiers import Tiers

MODEL = "tiny/qwen3"
STAGES = ("zero3", "zero2", "deepspeed-zero3", "deepspeed-zero2")


def _spec(**fields) -> StepSpec:
    base = {"model": MODEL, "method": "streambp", "seq_len_tokens": 128, "partition_size": 32,
            "head_partition_size": 16, "optimizer": "adamw", "gpus": 4}
    return StepSpec.of(**{**base, **fields})


def _tracked_depths(model: ResolvedModel) -> list:
    return [key for key in model.memo if isinstance(key, tuple) and key[0] == "phases"]


def test_a_spec_simulated_again_is_answered_from_the_memo() -> None:
    model = ResolvedModel(load_config(MODEL))
    spec = _spec(shard="zero3")
    first = simulate(spec, model)
    assert simulate(spec, model) is first
    assert simulate(spec, model, depth="full") is not first  # another depth is another simulation
    assert simulate(spec, model, depth="full").full_depth


@pytest.mark.slow
@pytest.mark.parametrize("offload", [Tiers.NONE, Tiers(checkpoints=True),
                                     Tiers(checkpoints=True, optimizer=True)])
def test_the_stages_of_one_step_share_its_simulation_with_a_fresh_models_figures(offload) -> None:
    shared = ResolvedModel(load_config(MODEL))
    for stage in STAGES:
        spec = _spec(shard=stage, offload=offload)
        try:
            alone = simulate(spec, ResolvedModel(load_config(MODEL)))
        except ConfigError as refusal:  # DeepSpeed ZeRO-2's offload_optimizer: refused either way
            with pytest.raises(ConfigError, match=str(refusal)[:40]):
                simulate(spec, shared)
            continue
        assert simulate(spec, shared) == alone, stage
    depths = len(shared.depth_plan.depths) if shared.depth_plan else 1
    stepped = 2 if offload.optimizer or offload.params else 1  # DeepSpeed's offload runs checkpoints only
    assert len(_tracked_depths(shared)) == stepped * depths


@pytest.mark.slow
@pytest.mark.parametrize(("method", "optimizer", "offload", "lora_rank", "sp"), [
    ("streambp", "adamw", Tiers.NONE, 0, 1),
    ("streambp", "adamw", Tiers(checkpoints=True, optimizer=True), 0, 1),
    ("streambp", "none", Tiers(checkpoints=True, params=True), 0, 1),
    ("streambp", "adamw", Tiers(checkpoints=True), 0, 2),
    ("mst", "adamw", Tiers(checkpoints=True), 4, 1),
    ("checkpoint", "adamw", Tiers.NONE, 0, 1),
])
def test_steps_at_other_lengths_and_partitions_give_a_fresh_models_figures(method, optimizer, offload,
                                                                          lora_rank, sp) -> None:
    shared = ResolvedModel(load_config(MODEL))
    sharded = {"gpus": sp, "sp": sp, "shard": "zero3"} if sp > 1 else {}
    for seq_len, partition, head in ((128, 32, 16), (96, 16, 32), (128, 128, 128), (200, 64, 16)):
        spec = StepSpec.of(model=MODEL, method=method, seq_len_tokens=seq_len, partition_size=partition,
                           head_partition_size=head, optimizer=optimizer, offload=offload,
                           lora_rank=lora_rank, **sharded)
        for depth in ("extrapolate", "full"):
            alone = simulate(spec, ResolvedModel(load_config(MODEL)), depth=depth)
            assert simulate(spec, shared, depth=depth) == alone, (seq_len, partition, head, depth)
