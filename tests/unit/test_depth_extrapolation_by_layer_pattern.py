"""Depth extrapolation on models whose layers differ by position: the shallow models are whole periods of
the layer pattern, every per-layer property at its index, and the extrapolated peak and estimated step
time are the full depth's. The default run takes one pattern per check (Llama 4's for the peak, Gemma 2's
for the step time), `-m slow` every pattern."""

from __future__ import annotations

import pytest

from streambp_core.config import StepSpec
from streambp_core.models import load_config, tiny_config
from streambp_core.step.estimate.ops import spec_step_ops
from streambp_core.step.estimate.roofline import GPU_MODELS, estimate_ops
from streambp_core.step.estimate.step_estimate import estimate_step
from streambp_core.step.parts.depth import depth_plan, layer_kinds, with_depth
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.run.setup import build_setup
from streambp_core.step.simulation.simulate import simulate

SMALL = dict(partition_size=32, head_partition_size=16, dtype="bfloat16")
NOPE_EVERY_4TH = [1, 1, 1, 0] * 3
LINEAR_3_FULL_1 = (["linear_attention"] * 3 + ["full_attention"]) * 3

PATTERNS = {  # tiny models deep enough for a pattern: (family, overrides, depths the plan simulates)
    "llama4 MoE every 2nd layer, NoPE every 4th, chunked": (
        "llama4", dict(num_hidden_layers=12, moe_layers=list(range(1, 12, 2)), no_rope_layers=NOPE_EVERY_4TH,
                       num_local_experts=8), (4, 8)),
    "qwen3.5 3 linear then 1 full": (
        "qwen3.5", dict(num_hidden_layers=12, layer_types=LINEAR_3_FULL_1), (4, 8)),
    "gemma2 sliding/full, odd depth": ("gemma2", dict(num_hidden_layers=9), (3, 5)),
    "deepseek-v3 2 dense layers first": ("deepseek-v3", dict(num_hidden_layers=7, first_k_dense_replace=2,
                                                             n_routed_experts=8), (3, 4)),
}

LLAMA4, GEMMA2 = "llama4 MoE every 2nd layer, NoPE every 4th, chunked", "gemma2 sliding/full, odd depth"


def patterns(default: str) -> list:
    """PATTERNS' names as parameters, all but `default` slow."""
    return [pytest.param(name, marks=() if name == default else pytest.mark.slow) for name in PATTERNS]


@pytest.mark.parametrize(
    ("name", "depths"),
    [("Qwen/Qwen3-8B", (2, 3)), ("google/gemma-2-2b", (2, 4)), ("Qwen/Qwen3.5-0.8B", (4, 8)),
     ("meta-llama/Llama-4-Maverick-17B-128E", (4, 8)), ("deepseek-ai/DeepSeek-V3", (4, 5)),
     ("google/gemma-3-1b-it", (8, 14))],
)
def test_the_shallow_depths_are_whole_periods_with_every_layer_kind_at_its_index(name, depths) -> None:
    """Gemma 3 1B: 26 layers = 4 periods of 6 (5 sliding, 1 full) + 2 sliding: 8 and 14 layers keep the
    2 at the top; DeepSeek-V3: 3 dense layers, then MoE."""
    config = load_config(name)
    plan = depth_plan(config)
    assert plan is not None and plan.depths == depths
    kinds = layer_kinds(config)
    for depth in depths:
        assert layer_kinds(with_depth(config, depth)) == kinds[:depth]
    assert len(set(kinds[: depths[0]])) == len(set(kinds))  # every kind is simulated


def test_a_shallow_llama4_keeps_its_moe_and_nope_layers_where_they_are() -> None:
    config = load_config("meta-llama/Llama-4-Maverick-17B-128E")
    shallow = with_depth(config, 8)
    assert shallow.moe_layers == [1, 3, 5, 7] and shallow.no_rope_layers == [1, 1, 1, 0, 1, 1, 1, 0]
    assert shallow.layer_types == ["chunked_attention"] * 3 + ["full_attention"] + ["chunked_attention"] * 3 \
        + ["full_attention"]
    assert config.num_hidden_layers == 48 and len(config.moe_layers) == 24  # the original is untouched


def test_a_per_layer_list_of_unknown_meaning_is_simulated_at_full_depth() -> None:
    config = tiny_config("qwen3", num_hidden_layers=6)
    config.layer_scales = [1.0] * 6
    assert depth_plan(config) is None
    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=128, **SMALL)
    assert simulate(spec, config).full_depth


@pytest.mark.parametrize("method", ["plain", "streambp"])
@pytest.mark.parametrize("pattern", patterns(LLAMA4))
def test_extrapolated_peak_is_the_full_depth_peak_on_each_layer_pattern(pattern: str, method: str) -> None:
    """At 64 tokens: past the tiny Llama 4's attention chunk (16) and the tiny Gemma 2's window (8)."""
    family, overrides, depths = PATTERNS[pattern]
    model = ResolvedModel(tiny_config(family, **overrides))
    spec = StepSpec.of(model=f"tiny/{family}", method=method, seq_len_tokens=64, **SMALL)
    extrapolated, full = simulate(spec, model), simulate(spec, model, depth="full")
    assert extrapolated.layers_simulated == depths and full.full_depth
    assert abs(extrapolated.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes


def test_one_sharded_rank_of_a_pattern_extrapolates_to_its_full_depth_peak() -> None:
    """One rank of 2 under FSDP2 zero3 with AdamW: its weights and optimizer state are the shards of every
    layer kind (a Llama 4 extrapolated from dense layers alone went negative)."""
    family, overrides, _ = PATTERNS[LLAMA4]
    model = ResolvedModel(tiny_config(family, **overrides))
    spec = StepSpec.of(model="tiny/llama4", method="streambp", seq_len_tokens=64, optimizer="adamw", gpus=2,
                       shard="zero3", **SMALL)
    extrapolated, full = simulate(spec, model), simulate(spec, model, depth="full")
    assert min(extrapolated.breakdown_bytes.values()) >= 0
    assert abs(extrapolated.peak_bytes - full.peak_bytes) <= 0.01 * full.peak_bytes


def test_a_uniform_models_step_time_is_estimated_from_one_and_two_layers() -> None:
    plan = depth_plan(tiny_config("qwen3", num_hidden_layers=6), min_layers=1)
    assert plan is not None and plan.depths == (1, 2) and plan.periods_to_add == 5


@pytest.mark.parametrize("pattern", patterns(GEMMA2))
def test_estimated_step_time_is_the_full_depth_estimate_on_each_layer_pattern(pattern: str) -> None:
    """`estimate_step` extrapolates from whole periods (`depth_plan(min_layers=1)`, here the depths the
    memory simulation uses): every part equals the estimate of the ops recorded at full depth (1 and 2
    layers, as before, missed the MoE, full-attention or dense layers of the pattern)."""
    family, overrides, depths = PATTERNS[pattern]
    model = ResolvedModel(tiny_config(family, **overrides))
    spec = StepSpec.of(model=f"tiny/{family}", method="streambp", seq_len_tokens=64, **SMALL)
    gpu = GPU_MODELS["h100"]
    assert depth_plan(model.config, min_layers=1).depths == depths
    extrapolated = estimate_step(spec, gpu, model)
    full = estimate_ops(spec_step_ops(build_setup(spec, model.config, "meta"), model.memo), gpu,
                        kernel=extrapolated.kernel)
    assert extrapolated.launches == full.launches
    for part in ("matmul_s", "attention_s", "other_s", "launch_s"):
        assert getattr(extrapolated, part) == pytest.approx(getattr(full, part), rel=1e-3), part
