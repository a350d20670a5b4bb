"""Partitions chosen by the simulator (`fitting_partitions`) and the estimated time of a spec's step."""

from __future__ import annotations

from dataclasses import replace

import pytest

from streambp_core.config import GPU_MODEL_NAMES, ConfigError, StepSpec
from streambp_core.step.estimate.roofline import GPU_MODELS, gpu_model
from streambp_core.step.estimate.step_estimate import estimate_step
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.search.partitions import fitting_partitions, head_candidates, layer_candidates
from streambp_core.step.simulation.simulate import simulate

SPEC = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=1024, dtype="float32")
BUDGET = 5_003_706  # bytes: partitions (171, 256) fit, (256, 64) and (171, 512) do not


@pytest.fixture(scope="module")
def tiny() -> ResolvedModel:
    """SPEC's model resolved once for the module: its simulations share one memo (the search's own)."""
    return ResolvedModel(SPEC.model)


def _peak(tiny: ResolvedModel, partition: int, head: int) -> int:
    return simulate(SPEC.replaced(partition_size=partition, head_partition_size=head), tiny).peak_bytes


def test_the_largest_partitions_that_fit_are_chosen(tiny) -> None:
    chosen = fitting_partitions(SPEC, BUDGET, tiny)
    layers, heads = layer_candidates(1024), head_candidates(1024)
    assert (chosen.stream.partition_size, chosen.stream.head_partition_size) == (171, 256)
    assert _peak(tiny, 171, 256) <= BUDGET
    assert _peak(tiny, layers[layers.index(171) + 1], heads[0]) > BUDGET
    assert _peak(tiny, 171, heads[heads.index(256) + 1]) > BUDGET


def test_a_given_size_is_kept_and_nothing_fitting_is_refused(tiny) -> None:
    kept = fitting_partitions(SPEC.replaced(partition_size=100), BUDGET, tiny, layer=False)
    assert kept.stream.partition_size == 100
    with pytest.raises(ConfigError, match="no partition fits"):
        fitting_partitions(SPEC, 1000, tiny)
    checkpoint = replace(SPEC, method="checkpoint")
    assert fitting_partitions(checkpoint, BUDGET, tiny) == checkpoint


def test_estimated_step_adds_offload_copies_compute_cannot_hide() -> None:
    gpu = gpu_model("a100")
    spec = replace(SPEC, method="checkpoint", seq_len_tokens=256)
    resident = estimate_step(spec, gpu)
    offloaded = estimate_step(spec.replaced(offload="checkpoints"), gpu)
    sim = simulate(spec.replaced(offload="checkpoints"))
    copies_s = (sim.to_host_bytes + sim.to_device_bytes) / gpu.pcie_bytes_per_s
    assert sim.to_host_bytes > 0 and resident.transfer_s == 0
    assert offloaded.transfer_s == pytest.approx(max(0.0, copies_s - (offloaded.step_time_ms / 1e3
                                                                      - offloaded.transfer_s)))
    assert resident.step_time_ms > 0 and resident.source == "estimated"


def test_the_cli_choices_are_the_estimates_gpus() -> None:
    assert GPU_MODEL_NAMES == tuple(GPU_MODELS)
