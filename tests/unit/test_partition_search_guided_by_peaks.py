"""The partition search guided by the simulated peaks (`largest_fitting` with `peak`) picks what bisection
picks, for any peak that grows with the size, in fewer probes where the peak grows about linearly."""

from __future__ import annotations

import random

import pytest

from streambp_core.step.search.partitions import auto_partitions, largest_fitting, layer_candidates


def _counted(peak, budget):
    asked: set[int] = set()

    def fits(size: int) -> bool:
        asked.add(size)
        return peak(size) <= budget
    return fits, asked


@pytest.mark.parametrize("seed", range(40))
def test_the_guided_search_picks_bisections_answer_for_any_growing_peak(seed) -> None:
    rng = random.Random(seed)
    candidates = layer_candidates(rng.randrange(300, 2_000_000))
    steps = [rng.choice((0, 1, rng.randrange(1, 10**6))) for _ in candidates]
    peaks = dict(zip(candidates, (sum(steps[:i + 1]) for i in range(len(steps))), strict=True))
    budget = rng.randrange(0, max(peaks.values()) + 2)
    fits, _ = _counted(peaks.__getitem__, budget)
    assert largest_fitting(candidates, fits, peaks.__getitem__, budget) == largest_fitting(candidates, fits)


def test_a_linear_peak_takes_two_probes_past_the_ends() -> None:
    candidates = layer_candidates(262_144)
    peak = lambda size: 10_000 + 3 * size  # noqa: E731
    budget = peak(candidates[9]) + 1
    guided, guided_asked = _counted(peak, budget)
    plain, plain_asked = _counted(peak, budget)
    assert largest_fitting(candidates, guided, peak, budget) == largest_fitting(candidates, plain) \
        == candidates[9]
    assert len(guided_asked) == 4 < len(plain_asked)  # both ends, the crossing and the one above it


def test_auto_partitions_guided_by_peaks_pick_the_same_pair() -> None:
    peak = lambda layer, head: 5 * layer + 2 * head  # noqa: E731
    for budget in (3_000, 100_000, 700_000, 10**9):
        fits = lambda layer, head, budget=budget: peak(layer, head) <= budget  # noqa: E731
        assert auto_partitions(262_144, fits, peak=peak, budget=budget) == auto_partitions(262_144, fits)


@pytest.mark.parametrize("seed", range(20))
def test_a_layer_partition_known_to_fit_starts_the_search_and_changes_no_answer(seed) -> None:
    """`at_least` (the layer partition a step holding no more fitted): the same pair in no more checks;
    one that does not fit after all (a peak that is not the same step's) is ignored."""
    rng = random.Random(seed)
    seq_len = rng.randrange(300, 2_000_000)
    per_layer, per_head = rng.randrange(1, 9), rng.randrange(1, 9)
    peak = lambda layer, head: per_layer * layer + per_head * head  # noqa: E731
    budget = rng.randrange(per_layer * 64 + per_head * 64, per_layer * seq_len + per_head * seq_len)
    answer = auto_partitions(seq_len, lambda p, h: peak(p, h) <= budget, peak=peak, budget=budget)
    asked: list[tuple[int, int]] = []

    def fits(layer: int, head: int) -> bool:
        asked.append((layer, head))
        return peak(layer, head) <= budget

    lower = [size for size in layer_candidates(seq_len) if size <= answer[0]]
    floor = rng.choice(lower)
    assert auto_partitions(seq_len, fits, peak=peak, budget=budget, at_least=floor) == answer
    asked.clear()
    assert auto_partitions(seq_len, fits, at_least=answer[0]) == answer
    from_the_floor = len(asked)
    asked.clear()
    assert auto_partitions(seq_len, fits) == answer
    assert from_the_floor <= len(asked)
    too_large = max(layer_candidates(seq_len))
    if not fits(too_large, 64):
        assert auto_partitions(seq_len, fits, peak=peak, budget=budget, at_least=too_large) == answer


def test_a_peak_flat_then_linear_takes_at_most_three_probes_past_the_ends() -> None:
    """A step's peak is its highest phase: flat while a phase the partition does not set is highest, then
    linear. The first guided probe, a line from the flat part, falls short; from a size that fits where
    the peak already grows, the next line lands; from one still on the flat part, the search bisects."""
    candidates = [64 * 2**k for k in range(12)] + [262_144]
    peak = lambda size: max(50_000, 10_000 + 3 * size)  # noqa: E731
    for answer in (8, 10, 11):  # the peak grows from 13,334
        budget = peak(candidates[answer]) + 1
        guided, guided_asked = _counted(peak, budget)
        plain, plain_asked = _counted(peak, budget)
        assert largest_fitting(candidates, guided, peak, budget) == largest_fitting(candidates, plain) \
            == candidates[answer]
        assert len(guided_asked) <= 5  # both ends, the short probe, the answer, the one above it


def test_a_peak_that_stops_growing_takes_no_more_probes_than_bisection() -> None:
    """A head partition past a sequence-parallel rank's tokens changes nothing: equal misses above, where
    no line tells the crossing, the search bisects."""
    candidates = [64 * 2**k for k in range(12)] + [262_144]
    peak = lambda size: 20_000 + 3 * min(size, 32_000)  # noqa: E731
    for answer in range(9):  # below 32,000: above it every candidate fits alike
        budget = peak(candidates[answer]) + 1
        guided, guided_asked = _counted(peak, budget)
        plain, plain_asked = _counted(peak, budget)
        assert largest_fitting(candidates, guided, peak, budget) == largest_fitting(candidates, plain) \
            == candidates[answer]
        assert len(guided_asked) <= len(plain_asked) + 2  # the largest and one overshoot more at most
