"""The max-length search on synthetic probes: affine, convex, step-shaped, OOM exceptions, edge cases."""

from __future__ import annotations

import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from streambp_core.measure.cuda import oom_pool
from streambp_core.search import (
    OK,
    OOM,
    REFUSED,
    ProbeResult,
    default_tolerance,
    guided_max_len,
    max_trainable_length,
)

GIB = 2**30


def peaks(fn):
    """probe(seq_len) reporting fn(seq_len) as an ok peak."""
    return lambda t: ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=int(fn(t)), source="simulated")


def check_bracket(result, budget: int, fits) -> None:
    """The bracket's ends are real probes on each side of the budget, no wider than the tolerance."""
    lo, hi = result.bracket
    assert fits(lo) and (hi is None or not fits(hi))
    assert hi is None or hi - lo <= default_tolerance(lo)
    by_len = {p.seq_len_tokens: p for p in result.probes}
    assert by_len[lo].fits(budget) and (hi is None or not by_len[hi].fits(budget))
    assert result.max_len_tokens == lo and result.peak_at_max is by_len[lo]


@settings(max_examples=60, deadline=None)
@given(
    intercept_gib=st.floats(1, 60),
    per_token_kib=st.floats(1, 20_000),
    budget_gib=st.floats(1, 100),
    start=st.integers(2, 200_000),
)
def test_affine_peaks_converge_in_few_probes(intercept_gib, per_token_kib, budget_gib, start):
    def fn(t):
        return intercept_gib * GIB + per_token_kib * 1024 * t

    budget = int(budget_gib * GIB)
    result = max_trainable_length(peaks(fn), budget, start=start)
    if fn(2) > budget:
        assert result.max_len_tokens == 0 and result.bracket == (0, 2)
        return
    check_bracket(result, budget, lambda t: fn(t) <= budget)
    assert len(result.probes) <= 12


@settings(max_examples=40, deadline=None)
@given(a=st.floats(1e3, 1e6), b=st.floats(1, 1e4), budget_gib=st.floats(2, 80))
def test_convex_peaks_converge(a, b, budget_gib):
    def fn(t):
        return GIB + a * t + b * t * t  # quadratic in T, like plain attention without flash

    budget = int(budget_gib * GIB)
    result = max_trainable_length(peaks(fn), budget)
    check_bracket(result, budget, lambda t: fn(t) <= budget)
    assert len(result.probes) <= 25


def test_step_shaped_peaks_converge() -> None:
    """Plateaus (memory grows per 1000-token block) defeat the secant; bisection still closes in."""

    def fn(t):
        return 10 * GIB + math.ceil(t / 1000) * GIB

    result = max_trainable_length(peaks(fn), 60 * GIB + 1)
    check_bracket(result, 60 * GIB + 1, lambda t: fn(t) <= 60 * GIB + 1)
    assert 50_000 - default_tolerance(50_000) <= result.max_len_tokens <= 50_000


def test_oom_exceptions_are_data_points() -> None:
    """Above 30k tokens the probe raises CUDA OOM (no peak); the search bisects and never raises."""

    def probe(t: int) -> ProbeResult:
        if t > 30_000:
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=t * 1024, source="measured-cuda")

    result = max_trainable_length(probe, 80 * GIB, oom_pool=oom_pool)
    check_bracket(result, 80 * GIB, lambda t: t <= 30_000)
    assert any(p.status == OOM and "out of memory" in p.message for p in result.probes)


def test_oom_results_and_refusals_count_as_failures() -> None:
    def probe(t: int) -> ProbeResult:
        if t > 20_000:
            return ProbeResult(seq_len_tokens=t, status=REFUSED, message="needs more RAM")
        if t > 10_000:
            return ProbeResult(seq_len_tokens=t, status=OOM)
        return ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=t)

    result = max_trainable_length(probe, 10**12, start=50_000)
    check_bracket(result, 10**12, lambda t: t <= 10_000)
    assert result.refused and result.refused[0].seq_len_tokens == 50_000


def test_other_exceptions_propagate() -> None:
    def probe(t: int) -> ProbeResult:
        raise ValueError("a bug, not an OOM")

    with pytest.raises(ValueError, match="a bug"):
        max_trainable_length(probe, GIB, oom_pool=oom_pool)


def test_everything_fits_up_to_max_len() -> None:
    result = max_trainable_length(peaks(lambda t: t), GIB, max_len=100_000)
    assert result.bracket == (100_000, None) and result.max_len_tokens == 100_000


def test_nothing_fits() -> None:
    result = max_trainable_length(peaks(lambda t: 2 * GIB + t), GIB, start=4096)
    assert result.max_len_tokens == 0 and result.bracket == (0, 2) and result.peak_at_max is None


def test_progress_callback_sees_every_probe_and_the_bracket() -> None:
    seen = []

    def on_probe(probe: ProbeResult, lo: int, hi: int | None) -> None:
        seen.append((probe.seq_len_tokens, lo, hi))

    result = max_trainable_length(peaks(lambda t: t * 1000), 50_000_000, on_probe=on_probe)
    assert [s[0] for s in seen] == [p.seq_len_tokens for p in result.probes]
    assert seen[-1][1:] == result.bracket


@pytest.mark.parametrize("full_extra_gib", [0.0, 3.0])
def test_guided_search_confirms_the_fitting_end_at_full_depth(full_extra_gib):
    """Full depth may peak higher than 2/3-layer extrapolation (never lower); the bracket must hold there."""

    def simulated(depth: str):
        extra = full_extra_gib * GIB if depth == "full" else 0
        return lambda t: ProbeResult(seq_len_tokens=t, status=OK,
                                     peak_bytes=int(30 * GIB + extra + 300_000 * t), message=depth)

    budget = 80 * GIB
    result = guided_max_len(simulated("extrapolate"), budget, confirm=simulated("full"), confirmed_layers=36)

    def full(t):
        return 30 * GIB + full_extra_gib * GIB + 300_000 * t

    lo, hi = result.bracket
    assert full(lo) <= budget < full(hi) and hi - lo <= default_tolerance(lo)
    assert result.peak_at_max.message == "full" and result.peak_at_max.seq_len_tokens == lo
    assert result.confirmed_layers == 36


@pytest.mark.parametrize("guide_extra_gib", [0.0, 3.0])
def test_a_guide_that_may_over_estimate_has_both_ends_confirmed(guide_extra_gib):
    """One sharded rank: the extrapolated guide may peak above full depth (3 GiB here); with both ends
    confirmed the bracket holds at full depth, where the answer is longer than the guide's."""

    def simulated(depth: str):
        extra = guide_extra_gib * GIB if depth == "extrapolate" else 0
        return lambda t: ProbeResult(seq_len_tokens=t, status=OK,
                                     peak_bytes=int(30 * GIB + extra + 300_000 * t), message=depth)

    budget = 80 * GIB
    guide, confirm = simulated("extrapolate"), simulated("full")
    guided = guided_max_len(guide, budget, confirm=confirm)
    result = guided_max_len(guide, budget, confirm=confirm, confirm_both_ends=True)

    def full(t):
        return 30 * GIB + 300_000 * t

    lo, hi = result.bracket
    assert full(lo) <= budget < full(hi) and hi - lo <= default_tolerance(lo)
    assert result.peak_at_max.message == "full" and result.peak_at_max.seq_len_tokens == lo
    assert {p.message for p in result.probes if p.seq_len_tokens == hi} >= {"full"}
    if guide_extra_gib:  # one end confirmed only: the guide's too-short answer stands
        assert guided.max_len_tokens < lo and full(guided.bracket[1]) <= budget


def test_guided_search_refines_from_the_guides_bracket():
    """A measured probe 2 GiB above the simulation: the refined answer is the measured one, and the
    measured search starts at the guide's fitting end."""
    guide = peaks(lambda t: 10 * GIB + 1_000_000 * t)
    measured_lengths: list[int] = []

    def measured(t: int) -> ProbeResult:
        measured_lengths.append(t)
        return ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=12 * GIB + 1_000_000 * t,
                           source="measured-cpu")

    result = guided_max_len(guide, 40 * GIB, refine=measured, confirmed_layers=2)
    lo, hi = result.bracket
    assert 12 * GIB + 1_000_000 * lo <= 40 * GIB < 12 * GIB + 1_000_000 * hi
    assert result.peak_at_max.source == "measured-cpu" and result.confirmed_layers == 2
    guided = max_trainable_length(guide, 40 * GIB)
    assert measured_lengths[0] == guided.max_len_tokens


@pytest.mark.slow
def test_child_process_probe_reports_one_json_line(tmp_path):
    """The plumbing `cuda_probe` uses, run on CPU: a fresh interpreter measures one step and prints JSON."""
    import json
    import subprocess
    import sys

    from streambp_core.config import StepSpec
    from streambp_core.step.search.probe import parse_child_output

    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=100, dtype="float32",
                       partition_size=32, head_partition_size=16)  # fmt: skip
    command = [sys.executable, "-m", "streambp_core.step.search.probe", "--spec", json.dumps(spec.to_dict()),
               "--device", "cpu"]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=300)
    result = parse_child_output(100, done.returncode, done.stdout, done.stderr)
    assert result.status == OK and result.source == "measured-cpu" and result.peak_bytes > 0


def test_child_failures_are_oom_data_points_or_errors():
    from streambp_core.step.search.probe import parse_child_output

    oom = parse_child_output(9000, 1, "", "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate")
    killed = parse_child_output(9000, -9, "", "")
    assert oom.status == OOM and killed.status == OOM
    with pytest.raises(RuntimeError, match="probe at 9000 tokens failed"):
        parse_child_output(9000, 1, "", "ImportError: no module named flash_attn")


def test_what_counts_as_an_oom_comes_from_the_caller() -> None:
    """Without `oom_pool` the search knows no OOM: a CUDA OOM exception propagates like any other."""

    def probe(t: int) -> ProbeResult:
        raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    with pytest.raises(torch.cuda.OutOfMemoryError):
        max_trainable_length(probe, GIB)
    result = max_trainable_length(probe, GIB, oom_pool=lambda exc: "host")
    assert {(p.status, p.oom_pool) for p in result.probes} == {(OOM, "host")}
