"""The max-len computation behind `streambp-bench max-len`: resolve the inputs once, then search each method.

Printing lives in `report`; the command module only wires options to these functions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from streambp_bench.specs import spec_label
from streambp_core.config import ConfigError, StepSpec, check_budget_gib, simulated_ranks_problem
from streambp_core.measure.units import GIB, format_size
from streambp_core.registry import method_class
from streambp_core.search import ProbeResult, SearchResult
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.parts.target import Target, resolve_target
from streambp_core.step.run.setup import resident_bytes
from streambp_core.step.search.partitions import searched
from streambp_core.step.search.probe import max_len


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to search: one step spec per method (AUTO partitions as asked; each searched as
    `step.search.partitions.searched` runs it), where, the model (its config resolved once, with the
    simulation memo its searches share) and what every step holds whatever its length (weights, grads,
    optimizer state)."""

    specs: tuple[StepSpec, ...]
    target: Target
    resolved: ResolvedModel
    resident_bytes: int
    host_budget_bytes: int | None = None
    """Host memory every search is also bounded by (offloaded checkpoints); None: reported, not bounded.
    One rank's share when the node's budget is shared (`ranks_per_node`)."""
    ranks_per_node: int = 1
    """Ranks sharing one node's host memory (`--gpus` runs: the node's budget / this is a rank's share)."""
    refused: tuple[tuple[str, str], ...] = ()
    """(method, why) of each method `--method all` left out because the model's family cannot run it
    (`methods.guards.family_refusals`: mst, on a baselines family whose pieces it lacks)."""

    @property
    def host_budget_words(self) -> str:
        """The host budget as given and, when shared, each rank's share: for messages."""
        if self.host_budget_bytes is None:
            return "none"
        share = self.host_budget_bytes / GIB
        if self.ranks_per_node == 1:
            return f"{share:g} GiB"
        node = share * self.ranks_per_node
        return f"{node:g} GiB per node ({share:.4g} GiB per rank, 1/{self.ranks_per_node} of it)"

    @property
    def model(self) -> str:
        return self.specs[0].model

    @property
    def labels(self) -> tuple[str, ...]:
        """Each spec's row label: its method, '+ offload' when it offloads (`specs.spec_label`)."""
        return tuple(spec_label(spec) for spec in self.specs)

    @property
    def offloads(self) -> bool:
        """Whether any spec keeps its checkpoints in host memory."""
        return any(spec.stream.offload for spec in self.specs)

    @property
    def budget_bytes(self) -> int:
        return int(self.target.budget_bytes or 0)

    @property
    def num_layers(self) -> int:
        return self.resolved.num_layers


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method's search."""

    spec: StepSpec
    """The step searched: its AUTO partitions until `maxlen.auto.finish` puts the sizes there that reach
    the maximum."""
    search: SearchResult
    how: str
    """How the peak at the maximum was obtained, in words."""

    @property
    def method(self) -> str:
        return self.spec.method

    @property
    def label(self) -> str:
        return spec_label(self.spec)


def make_plan(
    specs: tuple[StepSpec, ...], device: str, budget_gib: float | None, host_budget_gib: float | None = None,
    ranks_per_node: int = 1, *, every_method: bool = False,
) -> Plan:
    """Resolve the device, the budget and the model's config once; refuse a budget below what every step
    holds, and a host budget below what the shortest probe offloads (ConfigError, one line).
    `host_budget_gib` is one node's, shared by `ranks_per_node` ranks: the search bounds a rank's share.
    A method the model's family cannot run is refused by name; with `every_method` (`--method all`) it is
    left out instead (`Plan.refused`) while another method remains."""
    if not specs:
        raise ConfigError("give at least one method, or 'all'")
    check_budget_gib(host_budget_gib, "--host-budget-gib")
    target = resolve_target(device, budget_gib)
    if target.device != "sim" and specs[0].is_training_step:
        raise ConfigError("--objective/--lora-rank/--optimizer are simulated only for now: use --device sim")
    if (problem := simulated_ranks_problem(target.device, gpus=specs[0].gpus, sp=specs[0].sp,
                                           shard=specs[0].shard)) is not None:
        raise ConfigError(problem)
    resolved = ResolvedModel(specs[0].model)
    specs, refused = runnable(specs, resolved, every_method=every_method)
    needed = resident_bytes(specs[0], resolved.config)
    if needed >= (target.budget_bytes or 0):
        raise ConfigError(
            f"budget {target.budget_gib:g} GiB is below what every step of {specs[0].model} holds (weights, "
            f"grads, optimizer state: {format_size(needed)} in {specs[0].dtype}): no sequence length fits"
        )
    host_budget = None if host_budget_gib is None else int(host_budget_gib * GIB / ranks_per_node)
    plan = Plan(specs=specs, target=target, resolved=resolved, resident_bytes=needed,
                host_budget_bytes=host_budget, ranks_per_node=ranks_per_node, refused=refused)
    check_host_budget(plan)
    if target.device == "cpu":
        check_cpu_ram(plan)
    return plan


def runnable(specs: tuple[StepSpec, ...], resolved: ResolvedModel, *, every_method: bool
             ) -> tuple[tuple[StepSpec, ...], tuple[tuple[str, str], ...]]:
    """The specs whose method the model's family runs, and (method, why) of those it refuses
    (`methods.guards.family_refusals`, its reason without the method's name); ConfigError with the first
    refusal unless `every_method` leaves them out and another method remains."""
    from streambp_core.methods.guards import family_refusals

    refusals = family_refusals(resolved.config)
    kept = tuple(spec for spec in specs if spec.method not in refusals)
    refused = tuple(dict.fromkeys((spec.method, refusals[spec.method].removeprefix(f"{spec.method}: "))
                                  for spec in specs if spec.method in refusals))
    if refused and (not every_method or not kept):
        raise ConfigError(refusals[refused[0][0]])
    return kept, refused


SHORTEST_PROBE_TOKENS = 2
"""The shortest length a search probes (`search.max_trainable_length`'s min_len)."""


def check_host_budget(plan: Plan) -> None:
    """ConfigError (one line) when the host budget is below what an offloaded step holds in host memory
    at the shortest length a search probes (simulated): then no length fits, whatever the device."""
    if plan.host_budget_bytes is None:
        return
    from streambp_core.step.parts.host_pool import host_resident_bytes
    from streambp_core.step.simulation.simulate import simulate

    for spec in (spec for spec in plan.specs if spec.offload.optimizer):
        held = host_resident_bytes(spec, plan.resolved.config)["optimizer"]
        rank = "" if spec.shard == "none" else f", one rank's shard of {spec.gpus}"
        held = held if spec.shard == "none" else round(held * _trainable_fraction(plan, spec))
        if held > plan.host_budget_bytes:
            raise ConfigError(
                f"host budget {plan.host_budget_words} is below the optimizer's states "
                f"{spec_label(spec)} keeps in host memory (fp32 masters + AdamW moments{rank}: "
                f"{format_size(held)}): no sequence length fits"
            )

    for spec in (spec for spec in plan.specs if spec.offload):
        shortest = max(SHORTEST_PROBE_TOKENS, spec.sp)  # a token per sequence-parallel rank at least
        need = simulate(searched(spec).at(shortest), plan.resolved).host_peak_bytes
        if need > plan.host_budget_bytes:
            raise ConfigError(
                f"host budget {plan.host_budget_words} is below what {spec_label(spec)} holds in "
                f"host memory at {shortest} tokens ({format_size(need)}, simulated): no "
                "sequence length fits"
            )


def _trainable_fraction(plan: Plan, spec: StepSpec) -> float:
    """A rank's share of the trainable parameters under `spec`'s sharding (`simulate.shard_layout`)."""
    from streambp_core.step.simulation.simulate import shard_layout

    return shard_layout(spec, plan.resolved.config, plan.resolved.memo).trainable_fraction


def check_cpu_ram(plan: Plan) -> None:
    """ConfigError (one line) when even the shortest real CPU step of a spec would need more RAM than the
    machine may give it: every probe would be refused, so there is no length to report."""
    from streambp_core.step.search.probe import cpu_ram_refusal

    for spec in plan.specs:
        refusal = cpu_ram_refusal(searched(spec).at(SHORTEST_PROBE_TOKENS), plan.resolved)
        if refusal is not None:
            raise ConfigError(f"{spec_label(spec)} at {SHORTEST_PROBE_TOKENS} tokens on the CPU: {refusal}")


def check_refused(results: list[MethodResult]) -> None:
    """ConfigError when a search found no length because its probes were refused (not run: RAM), so that
    `max length 0` is never reported as an answer."""
    for result in results:
        if result.search.max_len_tokens == 0 and result.search.refused:
            why = result.search.refused[0].message
            raise ConfigError(f"{result.label}: no length could be measured: {why}")


def check_something_fits(plan: Plan, results: list[MethodResult]) -> None:
    """ConfigError when no method fits even the shortest length the search probes, so that a table of
    `max length 0` is never printed as an answer."""
    if not results or any(result.search.max_len_tokens > 0 for result in results):
        return
    budget_words = f"{plan.budget_bytes / GIB:.4g} GiB" + (
        "" if plan.host_budget_bytes is None else f" (host {plan.host_budget_words})")
    shortest = [min(result.search.probes, key=lambda probe: probe.seq_len_tokens) for result in results
                if result.search.probes]
    measured = [probe for probe in shortest if probe.peak_bytes is not None]
    if not measured:
        raise ConfigError(f"nothing fits in {budget_words}: every method runs out of memory at the shortest "
                          "length probed")
    low = min(measured, key=lambda probe: probe.peak_bytes)
    label = next(result.label for result in results if low in result.search.probes)
    raise ConfigError(f"nothing fits in {budget_words}: the lowest peak at the shortest length probed is "
                      f"{format_size(low.peak_bytes)} ({label} at {low.seq_len_tokens:,} tokens, "
                      f"{low.source})")


OnProbe = Callable[[str, ProbeResult, int, int | None], None]
"""on_probe(label, result, ok_len, fail_len): after each probe of the step labelled `label`."""


def run_plan(plan: Plan, on_probe: OnProbe, *, workers: int = 1, context: Any | None = None
             ) -> list[MethodResult]:
    """Search every step of the plan (`step.search.probe.max_len`: guided by the extrapolated simulation,
    confirmed at full depth or refined by measurement); `on_probe(label, result, ok_len, fail_len)`
    after each probe.

    With a fork-server `context` (`workers.start_server`) a simulated plan's searches run on up to
    `workers` worker processes, the costliest first; else (a measured plan too: its probes need the
    machine) one after another here, sharing the model's simulation memo (a worker gets the model
    without it and starts its own, kept for every search it runs). Each search is the same either way,
    probe for probe (the memo changes no figure).
    """
    from streambp_bench.workers import Task, run_tasks

    context = context if plan.target.device == "sim" else None
    tasks = [Task(spec_label(spec), _search, (plan, spec), method_class(spec.method).search_cost)
             for spec in plan.specs]
    found = run_tasks(tasks, workers, context, on_probe)
    return [MethodResult(spec=spec, search=search, how=_how(plan, spec, search))
            for spec, search in zip(plan.specs, found, strict=True)]


def _search(plan: Plan, spec: StepSpec, on_probe: OnProbe) -> SearchResult:
    def report(result: ProbeResult, ok: int, fail: int | None) -> None:
        on_probe(spec_label(spec), result, ok, fail)

    return max_len(searched(spec), plan.budget_bytes, plan.target.device, plan.resolved, on_probe=report,
                   host_budget_bytes=plan.host_budget_bytes)


def _how(plan: Plan, spec: StepSpec, search: SearchResult) -> str:
    best = search.peak_at_max
    how = best.message if best is not None and plan.target.device == "sim" else plan.target.source
    return f"{how}; {spec.describe()}" if spec.is_training_step and best is not None else how
