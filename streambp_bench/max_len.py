"""The max-len computation behind `streambp-bench max-len`: resolve the inputs once, then search each method.

Printing lives in `max_len_report`; the command module only wires options to these functions.
"""

from __future__ import annotations

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


def run_plan(plan: Plan, on_probe: OnProbe) -> list[MethodResult]:
    """Search every method of the plan (`step.probe.max_len`: guided by the extrapolated simulation,
    confirmed at full depth or refined by measurement); `on_probe(method, result, ok_len, fail_len)`
    after each probe. One simulation memo serves every method.

    One process: forking worker processes after torch and peft have started threads can deadlock the
    workers (it did for a LoRA step), and spawned workers pay the imports again.
    """
    cache: dict = {}
    return [MethodResult(spec=spec, search=(search := _search(plan, spec, on_probe, cache)),
                         how=_how(plan, spec, search)) for spec in plan.specs]


def _search(plan: Plan, spec: StepSpec, on_probe: OnProbe, cache: dict) -> SearchResult:
    def report(result: ProbeResult, ok: int, fail: int | None) -> None:
        on_probe(spec.method, result, ok, fail)

    return max_len(spec, plan.budget_bytes, plan.target.device, plan.config, cache=cache, on_probe=report)


def _how(plan: Plan, spec: StepSpec, search: SearchResult) -> str:
    best = search.peak_at_max
    how = best.message if best is not None and plan.target.device == "sim" else plan.target.source
    return f"{how}; {spec.describe()}" if spec.is_training_step and best is not None else how
