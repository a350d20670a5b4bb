"""Maximum trainable sequence length: a secant-guided bracket, then bisection, OOM-safe.

The search is generic over where a probe's figure comes from (a simulation, a measurement on CUDA or
CPU): a probe is any callable `probe(seq_len) -> ProbeResult`. A probe that fails with out-of-memory
(a `ProbeResult` with status "oom", or an exception that the caller's `oom_pool` names a pool for) and a
probe whose peak is above the budget are both failures; the search never raises on OOM. What counts as
an OOM comes from the caller (e.g. `streambp_core.measure.cuda.oom_pool`); without one, every exception
propagates. It assumes the peak does not decrease with the length.

Two pools: with a host budget (offloaded checkpoints live in host memory) a probe fits when its device
peak is within the budget and its host peak within the host budget; the secant then follows whichever
pool is fuller, each peak scaled by its own budget.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass, field, replace

SEARCH_CAP_TOKENS = 100_000_000
"""The longest length a max-length search probes: a method that fits there is reported as fitting at
least this many tokens (capped), never as a maximum. 100M: above what 32 GPUs with sequence parallelism
reach on an 8B model (tens of millions), so the cap binds only where nothing else does."""
OK, OOM, REFUSED = "ok", "oom", "refused"

OomPool = Callable[[BaseException], str | None]
"""Which memory an exception ran out of (`OOM_POOLS`); None when it is no out-of-memory error."""
HOST_PINNED_POOL = "host pinned"
"""The pool of an offload tier's page-locked host copies (`measure.cuda.PinnedHostOutOfMemory`)."""
OOM_POOLS = ("device", "host", HOST_PINNED_POOL)
"""The memories a step can run out of: the GPU's, host RAM, pinned host memory."""
HOST_POOLS = ("host", HOST_PINNED_POOL)
"""The pools of host memory: a probe out of either is over any host budget."""


@dataclass(frozen=True, kw_only=True)
class ProbeResult:
    """One probe: the peak of a training step at `seq_len_tokens`, or why there is none."""

    seq_len_tokens: int
    status: str
    """'ok' (the step ran; `peak_bytes` is its peak), 'oom' (it ran out of memory) or 'refused' (not run,
    see `message`; counts as a failure)."""
    peak_bytes: int | None = None
    breakdown_bytes: dict[str, int] = field(default_factory=dict)
    """Bytes per category at the peak (may be empty for measured probes)."""
    source: str = ""
    """'simulated', 'measured-cuda' or 'measured-cpu'."""
    message: str = ""
    peak_reserved_bytes: int | None = None
    """The CUDA caching allocator's `max_memory_reserved` over the step; None off CUDA."""
    alloc_retries: int | None = None
    """The allocator's `num_alloc_retries` over the step (frees of its cache to retry a cudaMalloc)."""
    num_ooms: int | None = None
    """The allocator's `num_ooms` over the step; None off CUDA."""
    host_peak_bytes: int | None = None
    """Most bytes the step held at once in host memory (offloaded checkpoints); None where not taken."""
    to_host_bytes: int | None = None
    """Bytes the step copied device -> host; None where not taken."""
    to_device_bytes: int | None = None
    """Bytes the step copied host -> device; None where not taken."""
    oom_pool: str | None = None
    """On status 'oom': the memory that ran out, one of `OOM_POOLS`: 'device', 'host' (RAM) or 'host
    pinned' (page-locked host memory)."""

    def fits(self, budget_bytes: int, host_budget_bytes: int | None = None) -> bool:
        """Whether the step ran, its peak is within `budget_bytes` and (given a host budget) its host
        peak within `host_budget_bytes`."""
        if self.status != OK or self.peak_bytes is None or self.peak_bytes > budget_bytes:
            return False
        return host_budget_bytes is None or (self.host_peak_bytes or 0) <= host_budget_bytes

    def over_host_budget(self, host_budget_bytes: int | None) -> bool:
        """Whether the step ran out of host memory or its host peak is over `host_budget_bytes`."""
        if self.oom_pool in HOST_POOLS:
            return True
        return host_budget_bytes is not None and (self.host_peak_bytes or 0) > host_budget_bytes


@dataclass(frozen=True, kw_only=True)
class SearchResult:
    """The longest length found to fit, the bracket around the true maximum, and every probe."""

    max_len_tokens: int
    """Longest probed length that fits (0 when even `min_len` does not fit)."""
    peak_at_max: ProbeResult | None
    bracket: tuple[int, int | None]
    """(longest fitting length, shortest failing length); the second is None when `max_len` fits."""
    probes: list[ProbeResult]
    budget_bytes: int
    confirmed_layers: int | None = None
    """Decoder layers of the step that confirmed the answer (the model's full depth for a measured or a
    confirmed simulated search); None when nothing confirmed it."""
    host_budget_bytes: int | None = None
    """Host memory the probes were also judged against; None: the host pool was reported, not bounded."""

    @property
    def capped(self) -> bool:
        """Whether the longest length searched fits: the true maximum is that length or more."""
        return self.max_len_tokens > 0 and self.bracket[1] is None

    @property
    def refused(self) -> list[ProbeResult]:
        """Probes that were not run (e.g. a CPU probe needing more RAM than the machine has)."""
        return [p for p in self.probes if p.status == REFUSED]


def default_tolerance(ok_len: int) -> int:
    """Bracket width to stop at: max(1% of the fitting length, 128 tokens)."""
    return max(math.ceil(0.01 * ok_len), 128)


def max_trainable_length(
    probe: Callable[[int], ProbeResult],
    budget_bytes: int,
    *,
    start: int = 4096,
    second_len: int | None = None,
    tolerance: Callable[[int], int] = default_tolerance,
    min_len: int = 2,
    max_len: int = SEARCH_CAP_TOKENS,
    max_probes: int = 40,
    on_probe: Callable[[ProbeResult, int, int | None], None] | None = None,
    host_budget_bytes: int | None = None,
    oom_pool: OomPool | None = None,
) -> SearchResult:
    """Longest sequence length whose step fits in `budget_bytes`, to within `tolerance(ok_len)`.

    Steps:
    1. Bracket: probe `start`; while every probe fits, aim at the length where the line through the two
       latest peaks meets the budget (a little beyond it, at most x8 per step) until one fails; while
       every probe fails, aim below (at least /8 per step) until one fits or `min_len` fails.
    2. Refine: while the bracket (ok, fail) is wider than `tolerance(ok)`, probe where the line through
       the peaks at its ends meets the budget, offset by half a tolerance towards the nearer end so the
       next probe can close it; after a step that does not halve the bracket, bisect.
    `second_len`: where to probe after `start` when `start` fits (default: the secant's aim), e.g. the
    failing end of a simulated search's bracket when a measured search starts at its fitting end.
    `on_probe(result, ok_len, fail_len)` is called after each probe (e.g. for a progress bar).
    `host_budget_bytes`: also bound each probe's host peak (module docstring). `oom_pool`: what counts as
    an out-of-memory exception (a data point, status "oom"); None: every exception propagates.
    """
    search = _Search(probe, budget_bytes, tolerance, min_len, max_len, on_probe, host_budget_bytes, oom_pool)
    search.bracket(max(min(start, max_len), min_len), second_len)
    while search.open() and len(search.probes) < max_probes:
        search.refine()
    return search.result()


def guided_max_len(
    guide: Callable[[int], ProbeResult],
    budget_bytes: int,
    *,
    refine: Callable[[int], ProbeResult] | None = None,
    confirm: Callable[[int], ProbeResult] | None = None,
    confirmed_layers: int | None = None,
    on_probe: Callable[[ProbeResult, int, int | None], None] | None = None,
    host_budget_bytes: int | None = None,
    confirm_both_ends: bool = False,
    oom_pool: OomPool | None = None,
) -> SearchResult:
    """Max length guided by a cheap probe, then refined by measurement or confirmed by a full one.

    Steps:
    1. Search with `guide` (a depth-extrapolated simulation: cheap).
    2. `refine` (a measured probe): search again with it, starting at the guide's bracket.
    3. Else `confirm` (a full-depth simulation): probe the guide's answer with it; if that fits, keep the
       guide's bracket with that probe as the peak; if not, search again with `confirm` from there.
       Why only that end: the guide can only under-estimate a peak (a maximum of phases each affine in
       depth is convex in depth), so a length that fails guided fails confirmed too. With
       `confirm_both_ends` (a guide that may also over-estimate: one sharded rank, whose layout of the
       extrapolated categories is not affine) the failing end is confirmed too, and a search with
       `confirm` continues from it if it fits.
    `confirmed_layers` (the depth `refine`/`confirm` run at) is recorded on the result. Every probe is
    listed in the result, the guide's first. `host_budget_bytes` bounds every search's host peak too;
    `oom_pool` says what counts as an out-of-memory exception in every search (`max_trainable_length`).
    """
    host = {"host_budget_bytes": host_budget_bytes, "oom_pool": oom_pool}
    guided = max_trainable_length(guide, budget_bytes, on_probe=on_probe, **host)
    if refine is not None:
        start, second = max(guided.max_len_tokens, 2), guided.bracket[1]
        refined = max_trainable_length(
            refine, budget_bytes, start=start, second_len=second, on_probe=on_probe, **host
        )
        return replace(refined, probes=[*guided.probes, *refined.probes], confirmed_layers=confirmed_layers)
    if confirm is None or guided.peak_at_max is None:
        return replace(guided, confirmed_layers=confirmed_layers)
    lo, hi = guided.bracket
    ends = [(lo, True)] + ([(hi, False)] if confirm_both_ends and hi is not None else [])
    probes, peak = list(guided.probes), guided.peak_at_max
    for length, guided_fits in ends:
        check = confirm(length)
        probes.append(check)
        fits = check.fits(budget_bytes, host_budget_bytes)
        if fits != guided_fits:  # the full step contradicts the guide here: search on with it from here
            if on_probe is not None:
                on_probe(check, length if fits else 0, None if fits else length)
            full = max_trainable_length(confirm, budget_bytes, start=length, on_probe=on_probe, **host)
            return replace(full, probes=[*probes, *full.probes], confirmed_layers=confirmed_layers)
        if on_probe is not None:
            on_probe(check, lo, hi)
        peak = check if fits else peak
    return replace(guided, peak_at_max=peak, probes=probes, confirmed_layers=confirmed_layers)


class _Search:
    """State of one search: probes so far, the best fitting and the shortest failing probe."""

    def __init__(self, probe, budget_bytes, tolerance, min_len, max_len, on_probe, host_budget, oom_pool
                 ) -> None:
        self.probe_fn, self.budget, self.host_budget = probe, budget_bytes, host_budget
        self.oom_pool: OomPool | None = oom_pool
        self.tolerance, self.min_len, self.max_len, self.on_probe = tolerance, min_len, max_len, on_probe
        self.probes: list[ProbeResult] = []
        self.ok: ProbeResult | None = None
        self.fail: ProbeResult | None = None
        self.last_width: float = math.inf

    def run(self, seq_len: int) -> ProbeResult:
        try:
            result = self.probe_fn(seq_len)
        except Exception as exc:  # an OOM is a data point; any other error is a bug and propagates
            pool = None if self.oom_pool is None else self.oom_pool(exc)
            if pool is None:
                raise
            result = ProbeResult(seq_len_tokens=seq_len, status=OOM, message=" ".join(str(exc).split())[:200],
                                 oom_pool=pool)
        self.probes.append(result)
        if result.fits(self.budget, self.host_budget):
            if self.ok is None or seq_len > self.ok.seq_len_tokens:
                self.ok = result
        elif self.fail is None or seq_len < self.fail.seq_len_tokens:
            self.fail = result
        if self.on_probe is not None:
            self.on_probe(result, self.ok_len, self.fail_len)
        return result

    @property
    def ok_len(self) -> int:
        return self.ok.seq_len_tokens if self.ok else 0

    @property
    def fail_len(self) -> int | None:
        return self.fail.seq_len_tokens if self.fail else None

    def bracket(self, start: int, second_len: int | None) -> None:
        """Find one fitting and one failing length (or hit `min_len` / `max_len`)."""
        length = start
        while len(self.probes) < 40:
            fits = self.run(length).fits(self.budget, self.host_budget)
            if fits and length >= self.max_len or not fits and length <= self.min_len:
                return
            if self.ok is not None and self.fail is not None:
                return
            guess = self._secant()
            if fits and len(self.probes) == 1 and second_len is not None and second_len > length:
                length = min(self.max_len, second_len)
            elif fits:
                aim = length * 2 if guess is None else guess + self.tolerance(int(guess)) // 2
                length = min(self.max_len, max(length + 1, min(int(aim), length * 8)))
            else:
                aim = length // 2 if guess is None else guess - self.tolerance(int(guess)) // 2
                length = max(self.min_len, min(length - 1, max(int(aim), length // 8)))

    def open(self) -> bool:
        """Whether the bracket is still wider than the tolerance."""
        if self.fail is None or self.ok is None:
            return False
        return self.fail_len - self.ok_len > self.tolerance(self.ok_len)

    def refine(self) -> None:
        """One probe inside (ok, fail): secant-aimed, or the midpoint after a poor step."""
        lo, hi = self.ok_len, self.fail_len
        width, tol = hi - lo, self.tolerance(lo)
        guess = self._secant()
        if guess is None or width > self.last_width / 2 and self.last_width != math.inf:
            target = (lo + hi) // 2
        elif guess - lo <= tol:
            target = lo + tol  # the crossing is just above lo: try to close the bracket from above
        elif hi - guess <= tol:
            target = hi - tol  # just below hi: try to close it from below
        else:
            target = int(guess) - tol // 2
        self.last_width = width
        self.run(min(hi - 1, max(lo + 1, target)))

    def _secant(self) -> float | None:
        """Length where the line through two probes' peaks meets the budget (None without two peaks)."""
        points = [(p.seq_len_tokens, self._load(p)) for p in self._nearest_with_peaks()]
        if len(points) < 2:
            return None
        (t0, p0), (t1, p1) = points
        if t1 == t0 or p1 == p0:
            return None
        slope = (p1 - p0) / (t1 - t0)
        if slope <= 0:
            return None
        return t0 + (self.budget - p0) / slope

    def _load(self, probe: ProbeResult) -> float:
        """The probe's fuller pool in device bytes: its device peak, or its host peak scaled by
        budget / host budget when larger (the secant then meets the budget where either pool is full)."""
        if self.host_budget is None or not probe.host_peak_bytes:
            return probe.peak_bytes
        return max(probe.peak_bytes, probe.host_peak_bytes * self.budget / self.host_budget)

    def _nearest_with_peaks(self) -> list[ProbeResult]:
        """The bracket ends when both have peaks, else the two latest probes that have one."""
        ends = [p for p in (self.ok, self.fail) if p is not None and p.peak_bytes is not None]
        if len(ends) == 2:
            return ends
        with_peaks = [p for p in self.probes if p.peak_bytes is not None and p.status == OK]
        return with_peaks[-2:]

    def result(self) -> SearchResult:
        return SearchResult(
            max_len_tokens=self.ok_len,
            peak_at_max=self.ok,
            bracket=(self.ok_len, self.fail_len),
            probes=list(self.probes),
            budget_bytes=self.budget,
            host_budget_bytes=self.host_budget,
        )
