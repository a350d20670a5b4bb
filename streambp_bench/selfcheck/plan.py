"""The self-check as a plan of items, run in order, each writing its rows as it makes them.

An item is one check (`Item`): its rows, its estimated minutes on an H200 (`selfcheck.estimate`) and
whether it needs CUDA. `run_plan` runs the items in order: each row goes to the results file as soon as
it is made; when an item ends, a row more says how long it took (metric item_minutes, method
"selfcheck", model the item's name, the wall clock's minutes: source measured-<device>), status error with
the one-line reason when it failed, and the plan goes on with the next item (Ctrl-C still stops it).

The dry run (`dry_run_items`) runs the same plan with each item's work replaced by a stand-in that
writes one row, the item's estimated minutes (source estimated); a stand-in named in `fail` raises
instead, so the failure path runs too. `check_dry_run` then reads the file back: every item's rows in
plan order, each item's row written before the next item started, the failed item's error row and the
items after it done, and the estimated total within the budget.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field

from streambp_bench.results import ResultRow, provenance

ITEM_NAMES = ("verify", "families", "kernels", "memory", "offload-64k", "fsdp", "host-tiers", "max-len-cuda",
              "workspace", "time", "profile", "offload-256k")
"""The GPU plan's items in order (`items.plan_items`; a test holds the two equal): the names --skip and
--fail take, known before torch is imported."""
ITEM_METRIC = "item_minutes"
PLANNED_METRIC = "planned_minutes"
ITEM_METHOD = "selfcheck"


@dataclass(frozen=True)
class Item:
    """One check of the plan."""

    name: str
    what: str
    """One line: what it measures, at which settings."""
    run: Callable[[object], Iterable[ResultRow]]
    """rows(context): the check itself, yielding its rows as it makes them."""
    estimate_s: Callable[[object], float]
    """seconds(context): its estimated time on an H200 (`selfcheck.estimate`)."""
    cuda_only: bool = True
    """Run only on CUDA (the CPU check skips it); False: the CPU check runs it with the tiny plan."""


@dataclass(frozen=True)
class Outcome:
    """How one item went: rows written, wall-clock seconds, the error ('' when it passed)."""

    name: str
    rows: int
    seconds: float
    estimated_s: float
    error: str = ""


@dataclass
class Runner:
    """Runs items in order (module doc); `write(row)` stores a row, `clock()` reads seconds."""

    write: Callable[[ResultRow], None]
    device: str
    where: str
    clock: Callable[[], float] = time.monotonic
    on_item: Callable[[Outcome], None] | None = None
    on_start: Callable[[Item], None] | None = None
    minutes_rows: bool = True
    """Write every item's minutes row; False: only a failed item's (the CPU check keeps its minutes out
    of its CSV)."""
    estimates_s: dict[str, float] | None = None
    """Each item's H200 estimate by name (None: `item.estimate_s(context)`; a CPU plan's items take the
    GPU plan's estimates)."""
    outcomes: list[Outcome] = field(default_factory=list)

    def run(self, items: Sequence[Item], context: object,
            work: Callable[[Item, object], Iterable[ResultRow]] | None = None) -> list[Outcome]:
        """Run each item's rows (`work(item, context)` instead of `item.run` in a dry run)."""
        for item in items:
            if self.on_start is not None:
                self.on_start(item)
            start, made, error = self.clock(), 0, ""
            try:
                for row in (work or _own_work)(item, context):
                    self.write(row)
                    made += 1
            except Exception as failure:  # a failed item is a row; the plan goes on
                error = one_line(failure)
            seconds = self.clock() - start
            if self.minutes_rows or error:
                self.write(item_row(item.name, seconds, error, self.device, self.where))
            estimated = (item.estimate_s(context) if self.estimates_s is None
                         else self.estimates_s.get(item.name, 0.0))
            outcome = Outcome(item.name, made, seconds, estimated, error)
            self.outcomes.append(outcome)
            if self.on_item is not None:
                self.on_item(outcome)
        return self.outcomes


def _own_work(item: Item, context: object) -> Iterable[ResultRow]:
    return item.run(context)


def one_line(error: BaseException) -> str:
    """`Type: first line of the message`, at most 300 characters."""
    text = " ".join(str(error).split()) or "no message"
    return f"{type(error).__name__}: {text}"[:300]


def item_row(name: str, seconds: float, error: str, device: str, where: str) -> ResultRow:
    """The row an item ends with: its wall-clock minutes, status error with the reason when it failed."""
    return ResultRow(method=ITEM_METHOD, model=name, seq_len_tokens=0, metric=ITEM_METRIC, value=seconds / 60,
                     status="error" if error else "ok", error=error,
                     **provenance(f"measured-{device}", where))


def planned_row(item: Item, context: object, where: str) -> ResultRow:
    """A dry run's stand-in row: the item's estimated H200 minutes (source estimated)."""
    return ResultRow(method=ITEM_METHOD, model=item.name, seq_len_tokens=0, metric=PLANNED_METRIC,
                     value=item.estimate_s(context) / 60, **provenance("estimated", where))


def stand_in(fail: Iterable[str], where: str) -> Callable[[Item, object], Iterable[ResultRow]]:
    """The dry run's work for an item: its planned row, or a RuntimeError for an item named in `fail`."""
    failing = set(fail)

    def work(item: Item, context: object) -> Iterable[ResultRow]:
        if item.name in failing:
            raise RuntimeError(f"dry run: the stand-in of {item.name} fails as asked")
        yield planned_row(item, context, where)

    return work


def total_minutes(items: Sequence[Item], context: object) -> float:
    """The plan's estimated minutes on an H200."""
    return sum(item.estimate_s(context) for item in items) / 60


def check_dry_run(items: Sequence[Item], context: object, outcomes: Sequence[Outcome],
                  rows: Sequence[ResultRow], fail: Iterable[str], budget_minutes: float) -> list[str]:
    """What the dry run found wrong (empty: the plan's logic holds): see the module doc."""
    problems = []
    names = [item.name for item in items]
    ended = [row.model for row in rows if row.metric == ITEM_METRIC]
    if ended != names or [o.name for o in outcomes] != names:
        problems.append(f"items ended in the order {ended}, not the plan's {names}")
    expected = [(name, metric) for name in names for metric in
                ((ITEM_METRIC,) if name in set(fail) else (PLANNED_METRIC, ITEM_METRIC))]
    written = [(row.model, row.metric) for row in rows]
    if written != expected:
        problems.append(f"rows written {written}, expected {expected}")
    for outcome in outcomes:
        status = next((row.status for row in rows if row.metric == ITEM_METRIC and row.model == outcome.name),
                      None)
        if (status == "error") != (outcome.name in set(fail)):
            problems.append(f"{outcome.name}: its row's status is {status}, its stand-in "
                            f"{'failed' if outcome.name in set(fail) else 'passed'}")
    total = total_minutes(items, context)
    if total > budget_minutes:
        problems.append(f"the plan's estimate, {total:.1f} min, is over the {budget_minutes:g}-minute budget")
    return problems
