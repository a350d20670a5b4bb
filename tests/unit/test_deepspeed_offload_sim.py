"""The simulated DeepSpeed ZeRO-3 rank with DeepSpeed's own offload (`--shard deepspeed-zero3 --offload
optimizer[,params]`, `step.simulation.deepspeed_host`): the methods' step runs with the checkpoints tier
only, the device keeps the gathered units, DeepSpeed's buckets and the gradients in flight, and the host holds
what DeepSpeed allocates there (fp32 masters, moments, gradient partitions; with params the partitions)."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError, StepSpec
from streambp_core.models import load_config
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.simulation.deepspeed_host import engine_spec
from streambp_core.step.simulation.simulate import shard_layout, simulate

MODEL = "tiny/qwen3"


@pytest.fixture(scope="module")
def sim():
    model = ResolvedModel(load_config(MODEL))
    return lambda spec: simulate(spec, model)


def _spec(offload: str = "none", **fields) -> StepSpec:
    base = {"model": MODEL, "method": "streambp", "seq_len_tokens": 128, "partition_size": 32,
            "head_partition_size": 16, "dtype": "bfloat16", "optimizer": "adamw", "gpus": 2,
            "shard": "deepspeed-zero3", "offload": offload}
    return StepSpec.of(**{**base, **fields})


def test_deepspeed_holds_the_optimizer_and_params_tiers_itself():
    assert str(engine_spec(_spec("checkpoints,optimizer,params")).offload) == "checkpoints"
    assert str(engine_spec(_spec("optimizer")).offload) == "none"
    assert str(engine_spec(_spec("optimizer", shard="zero3")).offload) == "optimizer"  # FSDP2: the tiers' own
    with pytest.raises(ConfigError, match="deepspeed-zero2 is not simulated"):
        simulate(_spec("optimizer", shard="deepspeed-zero2"))


def test_offload_moves_deepspeeds_state_to_the_host(sim):
    layout = shard_layout(_spec(), load_config(MODEL))
    part, shards = layout.partition_numel, layout.total("shard")
    kept, optimizer, params = sim(_spec()), sim(_spec("optimizer")), sim(_spec("optimizer,params"))
    assert kept.host_peak_bytes == 0 and kept.breakdown_bytes["optimizer"] == 12 * part
    # fp32 master and moments (12 bytes), the bf16 gradient partition (2) and the fp32 gradient (4)
    assert optimizer.host_peak_bytes == 18 * part
    assert optimizer.breakdown_bytes["optimizer"] == 0
    assert optimizer.to_host_bytes == 6 * part and optimizer.to_device_bytes == 4 * part
    assert params.host_peak_bytes == 18 * part + shards
    assert params.to_device_bytes == 2 * part + 2 * shards  # each partition gathered twice
    assert params.breakdown_bytes["weights"] == optimizer.breakdown_bytes["weights"] - shards
    for category in ("checkpoints", "kv", "logits"):  # the rank's activations stay as they were
        assert params.breakdown_bytes[category] == kept.breakdown_bytes[category], category
    assert params.peak_bytes < optimizer.peak_bytes < kept.peak_bytes


def test_the_checkpoints_tier_stays_the_methods_own(sim):
    alone = sim(_spec("optimizer,params"))
    with_checkpoints = sim(_spec("checkpoints,optimizer,params"))
    assert with_checkpoints.host_peak_bytes > alone.host_peak_bytes
    assert with_checkpoints.to_host_bytes > alone.to_host_bytes  # the checkpoints copied out, and back
    assert with_checkpoints.to_device_bytes > alone.to_device_bytes


@pytest.mark.slow
def test_the_layout_holds_what_deepspeed_allocates_on_two_ranks():
    """Real DeepSpeed ZeRO-3 with its offload sections and CPU Adam (compiled on first use) on two gloo
    ranks under the tracker, beside the simulated rank: DeepSpeed's offloaded state is the simulated host
    pool, and the simulated device side an upper bound within 5 %. Behind STREAMBP_DEEPSPEED_MATRIX=full."""
    import os

    from streambp_core.parallel.deepspeed_memory import measure_deepspeed_pools
    from streambp_core.parallel.launch import available_cpus

    if os.environ.get("STREAMBP_DEEPSPEED_MATRIX") != "full" or available_cpus() < 2:
        pytest.skip("runs with STREAMBP_DEEPSPEED_MATRIX=full on two cores")
    pytest.importorskip("deepspeed")
    config = load_config(MODEL)
    specs = [_spec(offload) for offload in ("optimizer", "optimizer,params")]
    for spec, (rank, host) in zip(specs, measure_deepspeed_pools(specs, config), strict=True):
        sim = simulate(spec, ResolvedModel(config))
        assert host.peak_bytes > 0 and sim.host_peak_bytes == host.peak_bytes, spec.offload
        assert rank.peak_bytes <= sim.peak_bytes <= 1.05 * rank.peak_bytes, spec.offload
        assert sim.to_host_bytes == host.to_host_bytes, spec.offload
