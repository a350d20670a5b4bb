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


@pytest.mark.parametrize("seed", range(40))
def test_any_guess_changes_no_answer_and_a_right_one_takes_fewer_checks(seed) -> None:
    """`near` (the pair the same step runs under a stronger stage) and `at_least` (the pair it runs with
    fewer tiers): the same answer from any guess, below, at or above the answer or off the
    candidates, with and without peaks; the right `near`: two checks per search past the largest pair
    (the guess and the candidate above it); the right `at_least`: no more checks than none."""
    rng = random.Random(seed)
    seq_len = rng.randrange(300, 2_000_000)
    per_layer, per_head = rng.randrange(1, 9), rng.randrange(1, 9)
    budget = rng.randrange(per_layer * 64 + per_head * 64, per_layer * seq_len + per_head * seq_len)
    flat = rng.choice((0, rng.randrange(0, budget + 1)))  # a phase the partitions do not set
    peak = lambda layer, head: max(flat, per_layer * layer + per_head * head)  # noqa: E731
    asked: list[tuple[int, int]] = []

    def fits(layer: int, head: int) -> bool:
        asked.append((layer, head))
        return peak(layer, head) <= budget

    answer = auto_partitions(seq_len, fits)
    assert answer == auto_partitions(seq_len, fits, peak=peak, budget=budget)
    guesses = [answer, (rng.randrange(1, seq_len + 1), rng.randrange(1, seq_len + 1)), (1, 1),
               (seq_len, seq_len), (rng.choice(layer_candidates(seq_len)), answer[1])]
    for near in guesses:
        assert auto_partitions(seq_len, fits, near=near) == answer, near
        assert auto_partitions(seq_len, fits, peak=peak, budget=budget, near=near) == answer, near
        assert auto_partitions(seq_len, fits, at_least=near) == answer, near
        assert auto_partitions(seq_len, fits, peak=peak, budget=budget, at_least=near) == answer, near
    asked.clear()
    auto_partitions(seq_len, fits, at_least=answer)
    from_the_floor = len(asked)
    asked.clear()
    auto_partitions(seq_len, fits)
    assert from_the_floor <= len(asked)
    asked.clear()
    auto_partitions(seq_len, fits, near=answer)
    largest = (max(layer_candidates(seq_len)), seq_len)
    if answer != largest:
        checks = 1 + (1 if answer[0] == largest[0] else 2) + (1 if answer[1] == seq_len else 2)
        assert len(asked) == checks, asked


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
