"""One rank of two under torch FSDP2, measured on CPU ranks (gloo) by the tracker, against the sharded
simulation of the same step: the simulation bounds the rank from above, by no more than what it assumes
in flight beyond what FSDP2 holds where these steps peak.

The steps (a tiny Qwen3 with a 4096-token vocabulary, so the state is visible next to the activations)
peak in the head's backward, before any decoder layer's: there FSDP2 holds no layer's gradients (the
simulation allows the root's and two layers' unsharded gradients throughout the backward) and, zero3,
one prefetched layer (the simulation two). Above the simulation by CPU artefacts only: AdamW's step
counters (4 bytes per parameter tensor, host tensors on CUDA) and the CPU attention kernel's extra copy
of its output (test_simulate.py's first test)."""

from __future__ import annotations

import itertools

import pytest
import torch

from streambp_core.config import StepSpec
from streambp_core.models import tiny_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.parallel.memory import measure_ranks
from streambp_core.step.parts.shards import rank_breakdown
from streambp_core.step.run.setup import build_setup
from streambp_core.step.run.tracked import tracked_step
from streambp_core.step.simulation.simulate import shard_layout, simulate

pytestmark = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")

CONFIG = tiny_config("qwen3", vocab_size=4096, hidden_size=128, intermediate_size=256)
CASES = list(itertools.product(("zero2", "zero3"), ("streambp", "checkpoint"), ("none", "adamw")))
DEFAULT_CASES = [("zero2", "streambp", "none"), ("zero3", "streambp", "adamw"),
                 ("zero2", "checkpoint", "adamw"), ("zero3", "checkpoint", "none")]
"""The per-phase test's cases in the default run, the rest `-m slow`: each stage with each method and each
optimizer once."""


def _spec(shard: str, method: str, optimizer: str) -> StepSpec:
    return StepSpec.of(model="tiny/qwen3", method=method, seq_len_tokens=256, partition_size=64,
                       head_partition_size=64, dtype="float32", optimizer=optimizer, gpus=2, shard=shard)


@pytest.fixture(scope="module")
def measured(request):
    """Rank 0's figures of every case this run's tests of the module take, from one set of two ranks."""
    taken = {item.callspec.params["case"] for item in request.session.items
             if item.module is request.module and hasattr(item, "callspec")}
    cases = [case for case in CASES if case in taken]
    return dict(zip(cases, measure_ranks([_spec(*case) for case in cases], CONFIG), strict=True))


def _cpu_extra_bytes(spec: StepSpec, config=CONFIG) -> int:
    """What a CPU rank holds that a GPU rank (and the simulation) does not (module docstring)."""
    counters = 4 * sum(1 for p in _meta_model(config).parameters()) if spec.optimizer == "adamw" else 0
    tokens = spec.stream.partition_size if spec.method == "streambp" else spec.seq_len_tokens
    attention_output = tokens * config.num_attention_heads * config.head_dim * 4
    return counters + config.num_hidden_layers * attention_output


def _meta_model(config=CONFIG):
    from streambp_core.models import build_model

    return build_model(config, dtype=torch.float32, device="meta", seed=0)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES, ids=["-".join(case) for case in CASES])
def test_the_simulated_rank_bounds_the_measured_one(measured, case):
    spec = _spec(*case)
    rank = measured[case]
    sim = simulate(spec, CONFIG)
    layout = shard_layout(spec, CONFIG)
    allowance = layout.inflight_grad_bytes()
    if spec.shard == "zero3":
        allowance += max(unit.full for unit in layout.units[1:])
    assert rank.source == "measured-cpu" and "rank 0 of 2" in rank.how
    assert max(rank.phase_peaks_bytes, key=rank.phase_peaks_bytes.get) == "backward"
    assert sim.peak_bytes - allowance <= rank.peak_bytes <= sim.peak_bytes + _cpu_extra_bytes(spec)
    for category in ("checkpoints", "kv", "logits"):  # activations: a rank's own, as simulated
        assert rank.breakdown_bytes[category] == sim.breakdown_bytes[category], category


@pytest.mark.parametrize("case", [
    pytest.param(case, id="-".join(case), marks=() if case in DEFAULT_CASES else pytest.mark.slow)
    for case in CASES])
def test_every_phase_is_bounded_and_zero2s_forward_is_exact(measured, case):
    """Per phase, the simulated rank at the phase's peak and end against the measured phase peak; zero2's
    forward holds exactly what the simulation lays out, the last layer's all-gather output included."""
    spec = _spec(*case)
    simulated = _simulated_phases(spec)
    extra = _cpu_extra_bytes(spec)
    for name, peak in measured[case].phase_peaks_bytes.items():
        if name != "optimizer":  # its shard temporaries differ by bytes; never the peak (test above)
            assert peak <= simulated[name] + extra, name
    if spec.shard == "zero2":
        assert measured[case].phase_peaks_bytes["forward"] >= simulated["forward"] - extra


DEEP = tiny_config("qwen3", vocab_size=4096, hidden_size=128, intermediate_size=2048, num_hidden_layers=10)
"""Ten wide layers: one GPU holds more gradients at the backward's end than the head's logits weigh, so it
peaks there; a rank holds half of those gradients and peaks in the head's backward instead."""


def test_a_rank_peaking_where_one_gpu_does_not_is_bounded_too():
    """The step's one-GPU peak, laid out as the rank holds it, falls short of the measured rank: the rank
    peaks at the LM head's logits, before the layers' gradients. The simulation lays out that point too
    (the activation peak), so it bounds the rank as in the tests above."""
    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=512, partition_size=64,
                       head_partition_size=512, dtype="float32", optimizer="adamw", gpus=2, shard="zero3")
    [rank] = measure_ranks([spec], DEEP)
    sim = simulate(spec, DEEP, depth="full")
    record = tracked_step(build_setup(spec, DEEP, "meta"), "meta")
    backward = next(phase.result for phase in record.phases if phase.name == "backward")
    layout = shard_layout(spec, DEEP)
    at_one_gpu_peak = sum(rank_breakdown(spec, layout, backward.peak_breakdown_bytes, "backward").values())
    extra = _cpu_extra_bytes(spec, DEEP)
    assert backward.peak_breakdown_bytes["logits"] == 0 < backward.activation_peak_breakdown_bytes["logits"]
    assert at_one_gpu_peak + extra < rank.peak_bytes
    allowance = layout.inflight_grad_bytes() + max(unit.full for unit in layout.units[1:])
    assert sim.peak_bytes - allowance <= rank.peak_bytes <= sim.peak_bytes + extra
    assert rank.breakdown_bytes["logits"] == sim.breakdown_bytes["logits"] > 0


def _simulated_phases(spec: StepSpec) -> dict[str, int]:
    """One rank's simulated bytes per phase: the most of the phase's peak and end, laid out."""
    record = tracked_step(build_setup(spec, CONFIG, "meta"), "meta")
    layout = shard_layout(spec, CONFIG)
    names = [phase.name for phase in record.phases]
    last_backward = max(i for i, name in enumerate(names) if name not in ("forward", "optimizer"))
    phases = {}
    for i, phase in enumerate(record.phases):
        at_end = "optimizer" if i == last_backward else phase.name
        points = (rank_breakdown(spec, layout, phase.result.peak_breakdown_bytes, phase.name),
                  rank_breakdown(spec, layout, phase.result.activation_peak_breakdown_bytes, phase.name),
                  rank_breakdown(spec, layout, phase.result.end_breakdown_bytes, at_end))
        phases[phase.name] = max(sum(point.values()) for point in points)
    return phases
