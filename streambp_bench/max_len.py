"""The max-len computation behind `streambp-bench max-len`: resolve the inputs once, then search each method.

Printing lives in `max_len_report`; the command module only wires options to these functions.
"""

from __future__ import annotations

import multiprocessing
import os
import queue
from collections.abc import Callable
from dataclasses import dataclass

from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.units import format_size
from streambp_core.models import load_config
from streambp_core.search import ProbeResult, SearchResult
from streambp_core.step.probe import max_len
from streambp_core.step.setup import resident_bytes
from streambp_core.step.target import Target, resolve_target


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to search: one step spec per method, where, the model's config (resolved once) and what
    every step holds whatever its length (weights, grads, optimizer state)."""

    specs: tuple[StepSpec, ...]
    target: Target
    config: PretrainedConfig
    resident_bytes: int

    @property
    def model(self) -> str:
        return self.specs[0].model

    @property
    def methods(self) -> tuple[str, ...]:
        return tuple(spec.method for spec in self.specs)

    @property
    def budget_bytes(self) -> int:
        return int(self.target.budget_bytes or 0)

    @property
    def num_layers(self) -> int:
        return self.config.num_hidden_layers


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method's search."""

    spec: StepSpec
    search: SearchResult
    how: str
    """How the peak at the maximum was obtained, in words."""

    @property
    def method(self) -> str:
        return self.spec.method


def make_plan(specs: tuple[StepSpec, ...], device: str, budget_gib: float | None) -> Plan:
    """Resolve the device, the budget and the model's config once; refuse a budget below what every step
    holds (ConfigError, one line)."""
    if not specs:
        raise ConfigError("give at least one method, or 'all'")
    target = resolve_target(device, budget_gib)
    if target.device != "sim" and specs[0].is_training_step:
        raise ConfigError("--objective/--lora-rank/--optimizer are simulated only for now: use --device sim")
    config = load_config(specs[0].model)
    needed = resident_bytes(specs[0], config)
    if needed >= (target.budget_bytes or 0):
        raise ConfigError(
            f"budget {target.budget_gib:g} GiB is below what every step of {specs[0].model} holds (weights, "
            f"grads, optimizer state: {format_size(needed)} in {specs[0].dtype}): no sequence length fits"
        )
    return Plan(specs=specs, target=target, config=config, resident_bytes=needed)


OnProbe = Callable[[str, ProbeResult, int, int | None], None]
_SEARCH_COST = {"streambp": 3, "mst": 2, "checkpoint": 1, "plain": 0}
"""Which searches take longest (the chunked methods reach the longest lengths, whose full-depth
confirmation runs the most chunk loops): started first, so the others share the remaining workers."""
_START_METHOD = "fork" if "fork" in multiprocessing.get_all_start_methods() else "spawn"
"""fork: a worker starts with the imports done (a simulation runs no kernel, so no thread pool of the
parent's is in use when it forks); spawn elsewhere."""


def run_plan(plan: Plan, on_probe: OnProbe, workers: int | None = None) -> list[MethodResult]:
    """Search every method of the plan (`step.probe.max_len`: guided by the extrapolated simulation,
    confirmed at full depth or refined by measurement); `on_probe(method, result, ok_len, fail_len)`
    after each probe.

    Simulated searches of several methods run in `workers` processes (default: one per CPU core, at
    most one per method): each is pure CPU work in Python, so processes are what scales. Measured
    searches run one after the other (they share the device).
    """
    workers = min(len(plan.specs), os.cpu_count() or 1) if workers is None else workers
    if plan.target.device != "sim" or workers < 2:
        cache: dict = {}
        searches = [_search(plan, spec, on_probe, cache) for spec in plan.specs]
    else:
        searches = _search_in_processes(plan, on_probe, workers)
    return [MethodResult(spec=spec, search=search, how=_how(plan, spec, search))
            for spec, search in zip(plan.specs, searches, strict=True)]


def _search(plan: Plan, spec: StepSpec, on_probe: OnProbe, cache: dict) -> SearchResult:
    def report(result: ProbeResult, ok: int, fail: int | None) -> None:
        on_probe(spec.method, result, ok, fail)

    return max_len(spec, plan.budget_bytes, plan.target.device, plan.config, cache=cache, on_probe=report)


def _search_in_processes(plan: Plan, on_probe: OnProbe, workers: int) -> list[SearchResult]:
    """`_search` of every spec, at most `workers` processes at a time; each reports its probes and then
    its result (or its error) on one queue, read here while they run."""
    context = multiprocessing.get_context(_START_METHOD)
    events = context.Queue()
    waiting = sorted(enumerate(plan.specs), key=lambda item: -_SEARCH_COST.get(item[1].method, 0))
    running: dict[int, multiprocessing.process.BaseProcess] = {}
    found: dict[int, SearchResult] = {}
    while len(found) < len(plan.specs):
        while waiting and len(running) < workers:
            index, spec = waiting.pop(0)
            running[index] = context.Process(target=_worker, args=(plan, index, spec, events), daemon=True)
            running[index].start()
        try:
            kind, index, *payload = events.get(timeout=1.0)
        except queue.Empty:
            _check_alive(plan, running)
            continue
        if kind == "probe":
            on_probe(*payload)  # (method, result, ok_len, fail_len)
            continue
        running.pop(index).join()
        if kind == "error":
            raise RuntimeError(f"{plan.specs[index].method}: {payload[0]}")
        found[index] = payload[0]
    return [found[index] for index in range(len(plan.specs))]


def _check_alive(plan: Plan, running: dict) -> None:
    """RuntimeError naming a worker that ended without reporting (e.g. killed for memory)."""
    for index, process in running.items():
        if process.exitcode is not None:
            raise RuntimeError(f"{plan.specs[index].method}: its search process ended with exit code "
                               f"{process.exitcode} before reporting a result")


def _worker(plan: Plan, index: int, spec: StepSpec, events) -> None:
    """One method's search in a worker process: ("probe", ...) events, then ("done", index, result)."""
    try:
        search = _search(plan, spec, lambda *event: events.put(("probe", index, *event)), {})
    except Exception as error:  # handed to the parent, which raises it
        events.put(("error", index, " ".join(str(error).split())))
        return
    events.put(("done", index, search))


def _how(plan: Plan, spec: StepSpec, search: SearchResult) -> str:
    best = search.peak_at_max
    how = best.message if best is not None and plan.target.device == "sim" else plan.target.source
    return f"{how}; {spec.describe()}" if spec.is_training_step and best is not None else how
