"""Partition sizes chosen, not guessed: the largest layer and LM-head partitions whose step fits.

The paper's advice is the largest partition that fits the memory: fewer, larger chunks mean fewer
kernel launches and GEMMs that reach the GPU's peak. `auto_partitions` takes the check as a callable,
`fits(partition_size, head_partition_size) -> bool` (typically: the simulated peak of the step is within
the budget), so it serves the simulator, a measured probe or a test alike.

A spec asks for the choice with AUTO partitions (`config.AUTO`): `searched` is the spec a max-length
search runs before the length is known (AUTO at MIN_PARTITION), `resolve_partitions` the spec that runs
at its length (AUTO replaced by the largest that fit).

Candidates: the layer partition splits the sequence into k equal chunks (ceil(T / k) for k = 1, 2, 3, 4,
6, 8, 12, 16, ...: the paper's T/3 is among them); the head partition is T or a power of two from
`min_head` up. Peaks grow with each partition and the two act in different phases of the step (layer
backward vs LM head), so the layer partition is chosen first with the smallest head partition, then the
largest head partition that still fits with it; each by bisection over its sorted candidates. The largest
pair is tried first, so a step that fits whole costs one check.
"""

from __future__ import annotations

from bisect import bisect_right
from collections.abc import Callable, Sequence

from streambp_core.config import MIN_AUTO_PARTITION, ConfigError

Fits = Callable[[int, int], bool]
NOTHING_FITS = "no partition fits"
"""How `auto_partitions`' ConfigError begins when even the smallest partitions do not fit."""
MIN_PARTITION = MIN_AUTO_PARTITION


def layer_candidates(seq_len: int, min_partition: int = MIN_PARTITION) -> list[int]:
    """Layer partitions ceil(T / k), ascending, for k in 1, 2, 3, 4, 6, 8, 12, 16, ... (x1.5 / x4/3
    steps), none below `min_partition` unless T itself is smaller, and `min_partition` itself (the
    smallest, so the longest length any candidate reaches is the one `min_partition` reaches)."""
    splits, k = [], 1
    while -(-seq_len // k) >= min_partition or k == 1:
        splits.append(k)
        k = k + 1 if k < 4 else (k * 3 // 2 if k % 4 == 0 else k * 4 // 3)
    return sorted({-(-seq_len // k) for k in splits} | {min(min_partition, seq_len)})


def head_candidates(seq_len: int, min_head: int = MIN_PARTITION) -> list[int]:
    """Head partitions, ascending: powers of two from `min_head` below T, then T."""
    sizes, size = [], min_head
    while size < seq_len:
        sizes.append(size)
        size *= 2
    return [*sizes, seq_len]


def largest_fitting(candidates: Sequence[int], fits: Callable[[int], bool],
                    peak: Callable[[int], float] | None = None, budget: float | None = None,
                    near: int | None = None, floor: int | None = None) -> int | None:
    """The largest of ascending `candidates` for which `fits` holds, assuming it holds up to some size and
    fails beyond; None when even the smallest fails. By bisection: log2(len) + 1 calls of `fits`. With
    `peak` (the figure `fits` compares with `budget`; asked only for sizes `fits` was asked about, so a
    memoised simulation answers it at no cost): the largest is tried too, then each probe goes where a
    line through known peaks crosses the budget (`_crossing`); past the first two such probes, a midpoint
    after one that did not halve the bracket. The same answer, in 2 or 3 probes past the ends where the
    peak is flat and then grows about linearly with the size (a step's peak is its highest phase: a
    partition sets some phases' peaks and not the others'). With `near` (the size a related step runs,
    likely the answer: the same step under a stronger shard stage): the largest candidate up to it is
    asked first, then, when it fits, the one above it, so a right guess takes two calls. With `floor`
    instead (a size likely to fit: the same step with fewer tiers ran it), the largest candidate up to
    it is asked first, then the search goes on as without it. Either answer narrows the bracket the
    search goes on in, so the answer is the same with any guess or none."""
    low, high = 0, len(candidates) - 1
    failed: list[int] = []  # indices known not to fit, ascending
    first = 0  # the smallest candidate asked about that fits (where a flat peak would show)
    guess = near if near is not None else floor
    at = bisect_right(candidates, guess) - 1 if guess is not None else -1
    if at >= 0:
        if fits(candidates[at]):
            if at == high or (near is not None and not fits(candidates[at + 1])):
                return candidates[at]
            first, low = at, at + (near is not None)  # both known to fit
        else:
            failed, high = [at], at - 1
            if high < 0:
                return None
    if first == low == 0 and at != 0 and not fits(candidates[0]):  # unless asked above
        return None
    if peak is not None and high > low and not failed:
        if fits(candidates[high]):
            return candidates[high]
        failed, high = [high], high - 1  # from here on, candidates[high + 1] is known not to fit
    guided, probes = peak is not None, 0
    while low < high:
        width = high - low
        mid = _crossing(candidates, low, failed, peak, budget, first) if guided else (low + high + 1) // 2
        if fits(candidates[mid]):
            low = mid
        else:
            high, failed = mid - 1, [mid, *failed]
        probes += 1
        guided = peak is not None and (probes < 2 or 2 * (high - low) <= width)
    return candidates[low]


def _crossing(candidates: Sequence[int], low: int, failed: Sequence[int], peak: Callable[[int], float],
              budget: float, first: int = 0) -> int:
    """The index in [low + 1, failed[0] - 1] of the largest candidate at or below the size where a line
    meets `budget`: the line through the peaks of the two smallest candidates known not to fit (both over
    the budget, so both where the peak grows with the size), or with one known, through the peaks at
    `candidates[low]` (fits) and it. Where the two misses' peaks are equal (the peak stops growing above
    some size: a head partition past a rank's tokens), or the one that fits has the peak of the smallest
    asked about (`first`: it does not grow yet there), no line tells where it crosses: the midpoint."""
    high = failed[0] - 1
    if len(failed) > 1 and peak(candidates[failed[1]]) > peak(candidates[failed[0]]):
        x0, x1 = candidates[failed[0]], candidates[failed[1]]
    elif len(failed) > 1 or (low > first and peak(candidates[low]) <= peak(candidates[first])):
        return (low + high + 1) // 2
    else:
        x0, x1 = candidates[low], candidates[failed[0]]
    y0, y1 = peak(x0), peak(x1)
    size = x0 + (budget - y0) * (x1 - x0) / (y1 - y0) if y1 > y0 else candidates[low]
    below = sum(1 for candidate in candidates[low + 1:high + 1] if candidate <= size)
    return min(high, low + max(1, below))


def auto_partitions(seq_len: int, fits: Fits, *, partition_size: int | None = None,
                    head_partition_size: int | None = None, min_partition: int = MIN_PARTITION,
                    min_head: int = MIN_PARTITION, peak: Callable[[int, int], float] | None = None,
                    budget: float | None = None, near: tuple[int, int] | None = None,
                    at_least: tuple[int, int] | None = None) -> tuple[int, int]:
    """(partition_size, head_partition_size): the largest that fit; a size given is kept as it is.
    `peak`, `budget`: the figure `fits` compares and its bound, to guide each search (`largest_fitting`).
    `near`: the pair the same step runs under a stronger shard stage: each search asks about its size
    first (`largest_fitting`'s `near`). Without it, `at_least`: a pair likely to fit (the same step with
    fewer tiers ran it): each search starts there (`largest_fitting`'s `floor`). Either way the same
    answer, in fewer checks where the guess is close.

    Raises ConfigError when nothing fits even at the smallest candidates.
    """
    heads = [head_partition_size] if head_partition_size else head_candidates(seq_len, min_head)
    layers = [partition_size] if partition_size else layer_candidates(seq_len, min_partition)
    if fits(layers[-1], heads[-1]):  # the common case on a large GPU: one call
        return layers[-1], heads[-1]
    near_layer, near_head = near if near is not None else (None, None)
    floor_layer, floor_head = at_least if at_least is not None else (None, None)
    layer = largest_fitting(layers, lambda size: fits(size, heads[0]),
                            peak and (lambda size: peak(size, heads[0])), budget, near=near_layer,
                            floor=floor_layer)
    if layer is None:
        raise ConfigError(f"{NOTHING_FITS} at {seq_len} tokens, not even partition {layers[0]} with "
                          f"head partition {heads[0]}")
    head = largest_fitting(heads, lambda size: fits(layer, size), peak and (lambda size: peak(layer, size)),
                           budget, near=near_head, floor=floor_head)
    return layer, head


def searched(spec):
    """`spec` (a `StepSpec`) as a max-length search runs it: each AUTO partition at MIN_PARTITION, the
    smallest candidate (peaks only grow with a partition, so it reaches the longest length), the sizes
    given as they are. The one rule for an automatic partition before its length is known."""
    automatic = spec.stream.automatic
    return spec.replaced(**dict.fromkeys(automatic, MIN_PARTITION)) if automatic else spec


def resolve_partitions(spec, budget_bytes: int, model=None, *, near: tuple[int, int] | None = None,
                       at_least: tuple[int, int] | None = None):
    """`spec` (a `StepSpec`) with its AUTO partitions resolved at its length: the largest that fit
    `budget_bytes` (`fitting_partitions`), the sizes given kept; a method without partitions takes
    `searched`'s. `spec` itself when nothing reads AUTO. Raises ConfigError when even the smallest
    candidates do not fit. `model`, `near`, `at_least`: as in `fitting_partitions`."""
    automatic = spec.stream.automatic
    if not automatic:
        return spec
    return fitting_partitions(searched(spec), budget_bytes, model, layer="partition_size" in automatic,
                              head="head_partition_size" in automatic, near=near, at_least=at_least)


def fitting_partitions(spec, budget_bytes: int, model=None, *, layer: bool = True, head: bool = True,
                       near: tuple[int, int] | None = None, at_least: tuple[int, int] | None = None):
    """`spec` (a `StepSpec`) with the largest layer (`layer`) and/or head (`head`) partitions whose
    simulated peak fits `budget_bytes` (`auto_partitions`); the others as given. The search simulates
    at two shallow depths extrapolated (`step.parts.depth`); its answer is checked with every layer and, when
    that does not fit (extrapolation under-estimates where a phase's peak moves with depth), searched
    again at full depth. (A sharded rank's layout of extrapolated categories may over-estimate a peak
    instead: then the answer can be smaller than the largest that fit with every layer.) Each search
    is guided by the simulated peaks (`largest_fitting`). Raises
    ConfigError when even the smallest candidates do not fit. Methods without partitions come back
    unchanged. `model`: the spec's model resolved once (`step.parts.resolved.ResolvedModel`; None: resolved
    here). `near`, `at_least`: the partitions a related step runs, asked about first (`auto_partitions`:
    the same answer)."""
    from streambp_core.step.parts.resolved import resolved
    from streambp_core.step.simulation.simulate import simulate

    if not spec.partitioned or not (layer or head):
        return spec
    model = resolved(spec.model, model)

    def peak_at(depth: str) -> Callable[[int, int], int]:
        def peak(partition: int, head_partition: int) -> int:
            trial = spec.replaced(partition_size=partition, head_partition_size=head_partition)
            return simulate(trial, model, depth=depth).peak_bytes  # memoised: asking again is free
        return peak

    def search(depth: str) -> tuple[int, int]:
        peak = peak_at(depth)
        return auto_partitions(spec.seq_len_tokens, lambda p, h: peak(p, h) <= budget_bytes, **given,
                               peak=peak, budget=budget_bytes, near=near, at_least=at_least)

    given = {"partition_size": None if layer else spec.stream.partition_size,
             "head_partition_size": None if head else spec.stream.head_partition_size}
    sizes = search("extrapolate")
    if peak_at("full")(*sizes) > budget_bytes:
        sizes = search("full")
    return spec.replaced(partition_size=sizes[0], head_partition_size=sizes[1])
