"""StepSpec.head_mode reaches the run, and the simulator counts the fused head's gradient buffers."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError, StepSpec
from streambp_core.methods import prepare
from streambp_core.models import load_config
from streambp_core.step.run.setup import build_setup
from streambp_core.step.run.tracked import tracked_step

TINY = "tiny/qwen3"  # vocab 512, hidden 64, tied embeddings: head parameters = final norm + lm_head weight


def _forward_grads_bytes(spec: StepSpec) -> tuple[int, dict[str, int]]:
    """(grads bytes at the forward's peak, bytes by category at the end of the step)."""
    record = tracked_step(build_setup(spec, load_config(TINY), "meta"), "meta")
    forward = record.phases[0]
    assert forward.name == "forward"
    return forward.result.peak_breakdown_bytes["grads"], record.phases[-1].result.end_breakdown_bytes


def prepared_head_mode(spec: StepSpec) -> str:
    """The head mode of the run `prepare` makes of `spec`'s stream on a meta model."""
    setup = build_setup(spec, load_config(TINY), "meta")
    with prepare(setup.model, spec.method, spec.stream) as run:
        return run.config.head_mode


def test_the_fused_head_holds_one_gradient_per_head_parameter_from_forward_to_backward() -> None:
    """Resident grads: the forward's peak holds, beyond the resident gradients, a buffer per head
    parameter: vocab x hidden (lm_head) + hidden (final norm), float32."""
    config = load_config(TINY)
    expected = (config.vocab_size * config.hidden_size + config.hidden_size) * 4
    common = dict(model=TINY, method="streambp", seq_len_tokens=96, dtype="float32", partition_size=32,
                  head_partition_size=16, grads="resident")
    fused, _ = _forward_grads_bytes(StepSpec.of(head_mode="fused", **common))
    recomputed, _ = _forward_grads_bytes(StepSpec.of(head_mode="recompute", **common))
    assert fused - recomputed == expected


def test_gradients_the_engine_sets_by_hand_count_as_grads() -> None:
    """Fresh grads: after the step every parameter's gradient is filed under grads (the engine sets the
    lm_head's and the projections' `.grad` itself, which the accumulate-grad hook does not see)."""
    spec = StepSpec.of(model=TINY, method="streambp", seq_len_tokens=96, dtype="float32", partition_size=32,
                       head_partition_size=16, grads="fresh", head_mode="recompute")
    setup = build_setup(spec, load_config(TINY), "meta")
    record = tracked_step(setup, "meta")
    trainable = sum(p.nbytes for p in setup.model.parameters() if p.requires_grad)
    assert record.phases[-1].result.end_breakdown_bytes["grads"] == trainable


@pytest.mark.parametrize(("method", "objective", "asked", "resolved"), [
    ("streambp", "sft", "auto", "fused"), ("streambp", "grpo", "auto", "fused"),
    ("streambp", "dpo", "auto", "recompute"), ("checkpoint", "sft", "fused", "recompute"),
    ("streambp", "sft", "recompute", "recompute"),
])
def test_head_mode_resolves_per_method_and_objective(method, objective, asked, resolved) -> None:
    spec = StepSpec.of(model=TINY, method=method, objective=objective, head_mode=asked)
    assert spec.stream.head_mode == resolved
    assert prepared_head_mode(spec) == resolved


def test_a_fused_head_for_dpo_is_refused_by_name() -> None:
    with pytest.raises(ConfigError, match="head_mode fused"):
        StepSpec.of(model=TINY, method="streambp", objective="dpo", head_mode="fused")


def test_the_specs_fusable_objectives_are_the_engines() -> None:
    from streambp_core.config import FUSED_HEAD_OBJECTIVES
    from streambp_core.engine.stream.objectives import LINEAR_REDUCE_OBJECTIVES

    assert FUSED_HEAD_OBJECTIVES == LINEAR_REDUCE_OBJECTIVES
