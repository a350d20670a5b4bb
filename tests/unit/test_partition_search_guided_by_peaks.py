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
