"""One simulated rank of a Ulysses sequence-parallel step (`step.simulation.sequence_layout`) and its
estimated time (`step.estimate.sequence_time`), on tiny presets."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError, StepSpec
from streambp_core.step.estimate import sequence_time
from streambp_core.step.estimate.attention_kernels import attention_kernel
from streambp_core.step.estimate.ops import spec_step_ops
from streambp_core.step.estimate.roofline import GPU_MODELS, estimate_by_depth
from streambp_core.step.estimate.step_estimate import estimate_step
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.run.setup import build_setup
from streambp_core.step.simulation.sequence_layout import SequenceLayout, check_sequence_parallel
from streambp_core.step.simulation.simulate import simulate

SIZES = {"partition_size": 32, "head_partition_size": 16}


@pytest.fixture(scope="module")
def tiny() -> ResolvedModel:
    return ResolvedModel("tiny/llama")  # 4 query heads, 2 KV heads, 2 layers


def _spec(method: str, tokens: int, sp: int = 1, **fields) -> StepSpec:
    ranks = {"gpus": sp, "sp": sp, "shard": "zero3"} if sp > 1 else {}
    return StepSpec.of(model="tiny/llama", method=method, seq_len_tokens=tokens, **ranks, **SIZES, **fields)


@pytest.mark.parametrize("method", ["checkpoint", "streambp"])
def test_a_rank_holds_less_than_one_gpu_and_more_than_its_shard_alone(tiny, method):
    """The rank runs the engine's SP path: its shard, plus every token's K/V of its heads and the
    all-to-alls (their send and receive buffers allocated as a real rank's)."""
    tokens = 4096
    rank = simulate(_spec(method, tokens, sp=2), tiny)
    whole, shard = simulate(_spec(method, tokens), tiny), simulate(_spec(method, tokens // 2), tiny)
    activations = {name for name in rank.breakdown_bytes if name not in ("weights", "grads", "optimizer")}

    def held(result):
        return sum(result.breakdown_bytes[name] for name in activations)

    assert held(shard) < held(rank) < held(whole)
    assert "Ulysses" in rank.how and "send and receive buffers" in rank.how


def test_a_rank_swaps_its_shards_queries_and_replicated_kv(tiny):
    layout = SequenceLayout.of(_spec("streambp", 1000, sp=4), tiny.config)
    assert layout.shard_tokens == 250 and layout.kv_copies == 2  # 2 KV heads over 4 ranks: each twice
    head_dim = tiny.config.hidden_size // 4
    q, kv = 250 * 4 * head_dim * 2, 2 * 250 * 2 * 2 * head_dim * 2
    assert layout.q_bytes() == q and layout.kv_bytes() == kv
    assert layout.all_to_all_bytes("plain") == 2 * 2 * (2 * q + kv) * 3 // 4


def test_heads_that_do_not_split_are_refused_by_name(tiny):
    with pytest.raises(ConfigError, match="4 attention heads"):
        check_sequence_parallel(_spec("streambp", 1000, sp=8), tiny.config)
    with pytest.raises(ConfigError, match="4 attention heads"):
        simulate(_spec("streambp", 1000, sp=8), tiny)


def test_a_rank_holds_its_share_of_the_optimizers_host_state(tiny):
    tiers = {"optimizer": "adamw", "offload": "checkpoints,optimizer"}
    one = simulate(_spec("streambp", 512, **tiers), tiny)
    rank = simulate(_spec("streambp", 1024, 2, **tiers), tiny)
    from streambp_core.step.parts.host_pool import host_resident_bytes

    state = host_resident_bytes(_spec("streambp", 512, **tiers), tiny.config)["optimizer"]
    assert state > 0 and rank.host_peak_bytes < one.host_peak_bytes - state // 3


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_a_ranks_estimate_counts_every_chunk_of_a_long_step(tiny, method):
    """A rank's launches grow by the same count with each chunk (its loops run once per chunk), up to
    ten chunks, past the length fit's references (3k, 6k and 12k tokens: 1, 2 and 4 whole chunks). A fit
    through 2k, 4k and 8k tokens, which hold 1, 2 and 3 chunks of 3,000 tokens, counts no such line."""
    gpu = GPU_MODELS["h100"]

    def launches(chunks: int) -> int:
        spec = StepSpec.of(model="tiny/llama", method=method, seq_len_tokens=3_000 * chunks, gpus=2,
                           shard="zero3", partition_size=3_000, head_partition_size=3_000)
        return estimate_step(spec, gpu, tiny).launches

    one, two = launches(1), launches(2)
    assert two > one > 0
    assert launches(10) == one + 9 * (two - one)


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_the_length_fit_gives_the_step_recorded_op_by_op(tiny, method):
    """Past its references (4k, 8k and 16k tokens: whole chunks on each rank), the fit gives the step
    recorded op by op: at a length of whole chunks exactly, but for attention (its kernel's speed
    curve in the key length is no polynomial: within 0.1 %); within 1 % with a last chunk cut short."""
    gpu = GPU_MODELS["h100"]
    for tokens, within in ((32_768, 1e-9), (34_768, 0.01)):
        spec = StepSpec.of(model="tiny/llama", method=method, seq_len_tokens=tokens, gpus=2, sp=2,
                           shard="zero3", partition_size=512, head_partition_size=256)
        assert sequence_time.reference_lengths(spec)[-1] < tokens
        kernel = attention_kernel(spec.stream.attn, gpu.name)
        direct = estimate_by_depth(
            lambda depth, spec=spec: spec_step_ops(build_setup(spec, tiny.at_depth(depth), "meta")),
            tiny.config, gpu, kernel)
        fitted = sequence_time.rank_compute(spec, gpu, tiny)
        for field in ("matmul_s", "attention_s", "other_s", "launch_s", "launches"):
            rel = max(within, 1e-3) if field == "attention_s" else within
            assert getattr(fitted, field) == pytest.approx(getattr(direct, field), rel=rel), (tokens, field)


@pytest.mark.parametrize("head_mode, head_partition", [
    ("recompute", 512), pytest.param("fused", 32, marks=pytest.mark.slow)])
def test_a_step_whose_partitions_share_no_short_length_is_its_layers_plus_its_head(tiny, head_mode,
                                                                                   head_partition):
    """Partitions 600 and 512 (or the fused head's 32, whose norm runs per block of 16 chunks: 512) hold
    whole chunks together only every 38,400 tokens: the step is fitted as its layers' chunks plus its
    head's, each fitted apart, and that is the step recorded op by op."""
    gpu = GPU_MODELS["h100"]
    spec = StepSpec.of(model="tiny/llama", method="streambp", seq_len_tokens=38_400, gpus=2, shard="zero3",
                       partition_size=600, head_partition_size=head_partition, head_mode=head_mode)
    assert sequence_time._separately(spec) is not None
    kernel = attention_kernel(spec.stream.attn, gpu.name)
    direct = estimate_by_depth(lambda depth: spec_step_ops(build_setup(spec, tiny.at_depth(depth), "meta")),
                               tiny.config, gpu, kernel)
    split = sequence_time.rank_compute(spec, gpu, tiny)
    for field in ("matmul_s", "attention_s", "other_s", "launch_s", "launches"):
        rel = 1e-3 if field == "attention_s" else 1e-9
        assert getattr(split, field) == pytest.approx(getattr(direct, field), rel=rel), field


def test_the_all_to_alls_leave_the_node_past_eight_ranks():
    link = sequence_time.INTERCONNECTS["NVIDIA H100 SXM5 80GB"]
    sent = 70 * 10**9
    assert sequence_time.collective_s(sent, 8, link) == pytest.approx(sent / 450e9)
    assert sequence_time.collective_s(sent, 32, link) == pytest.approx(sent * 24 / 31 / 50e9)
    assert sequence_time.collective_s(sent, 1, link) == 0.0


@pytest.mark.parametrize(("family", "tokens", "sp", "fields"), [
    ("llama", 4103, 4, {}),  # 2 KV heads over 4 ranks (copies), shards and pieces of unequal sizes
    ("llama", 4096, 2, {"offload": "checkpoints", "optimizer": "adamw"}),  # equal shards and pieces
    ("deepseek-v3", 2050, 2, {"head_mode": "recompute"}),  # latent attention: the latent swapped whole
])
def test_thinned_loops_and_kv_swaps_give_a_ranks_figures_to_the_byte(family, tokens, sp, fields):
    """The K/V swaps of `KV_PIECES` all-to-alls run only their first and last piece in a thinned
    simulation, as the chunk loops run only their ends: the rank's peak, its breakdown and its host pool
    equal those of every chunk and every piece."""
    spec = StepSpec.of(model=f"tiny/{family}", method="streambp", seq_len_tokens=tokens, gpus=sp, sp=sp,
                       shard="zero3", partition_size=64, head_partition_size=64, **fields)
    model = ResolvedModel(f"tiny/{family}")
    thin, every = simulate(spec, model, depth="full"), simulate(spec, model, depth="full", keep_chunks=None)
    assert (thin.peak_bytes, thin.breakdown_bytes) == (every.peak_bytes, every.breakdown_bytes)
    host = ("host_peak_bytes", "to_host_bytes", "to_device_bytes")
    assert [getattr(thin, name) for name in host] == [getattr(every, name) for name in host]
