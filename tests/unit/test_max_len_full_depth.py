"""Every max-len answer holds at the model's full depth, training steps (objective, LoRA, AdamW) too."""

from __future__ import annotations

import pytest

from streambp_core.config import StepSpec
from streambp_core.models import tiny_config
from streambp_core.step.run.setup import resident_bytes
from streambp_core.step.search.probe import max_len
from streambp_core.step.simulation.simulate import simulate


@pytest.mark.slow
@pytest.mark.parametrize("method", ["checkpoint", "streambp"])
def test_a_training_step_answer_fits_at_full_depth_and_its_next_probe_does_not(method: str) -> None:
    """A 6-layer model is searched with 2/3-layer extrapolation, then confirmed with all 6 layers."""
    config = tiny_config("qwen3", num_hidden_layers=6, layer_types=["full_attention"] * 6)
    spec = StepSpec.of(model="tiny/qwen3", method=method, objective="grpo", batch_size=2, optimizer="adamw",
                       dtype="float32", partition_size=32, head_partition_size=16)
    budget = resident_bytes(spec, config) + 2 * 2**20
    search = max_len(spec, budget, "sim", config)
    ok, fail = search.bracket
    assert search.confirmed_layers == 6 and ok > 0 and fail is not None
    assert simulate(spec.at(ok), config, depth="full").peak_bytes <= budget
    assert simulate(spec.at(fail), config, depth="full").peak_bytes > budget
    assert search.peak_at_max.message == "simulated on meta tensors, all 6 layers"
