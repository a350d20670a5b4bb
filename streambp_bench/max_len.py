"""The max-len computation behind `streambp-bench max-len`: check the inputs, then search each method.

Printing lives in `max_len_report`; the command module only wires options to these functions.
"""

from __future__ import annotations

import functools
import platform
from collections.abc import Callable
from dataclasses import dataclass, field

from streambp_bench import options as opt
from streambp_core.config import METHODS, ConfigError, check_method
from streambp_core.measure.cuda import cuda_available, device_info
from streambp_core.measure.probe import ProbeSpec, cpu_probe, cuda_probe, simulated_max_len, simulated_probe
from streambp_core.measure.simulate import weights_and_grads_bytes
from streambp_core.measure.training_step import TrainSpec, simulated_training_probe
from streambp_core.measure.units import GIB
from streambp_core.models import load_config
from streambp_core.search import ProbeResult, SearchResult, max_trainable_length

SOURCE = {"sim": "simulated", "cpu": "measured-cpu", "cuda": "measured-cuda"}


@dataclass(frozen=True, kw_only=True)
class Plan:
    """What to search: resolved device and budget, the methods, and the step settings shared by all."""

    model: str
    methods: tuple[str, ...]
    device: str
    """'sim', 'cpu' or 'cuda' (auto resolved)."""
    device_name: str
    budget_bytes: int
    weights_grads_bytes: int
    num_layers: int
    spec: dict = field(default_factory=dict)
    """ProbeSpec fields except model and method."""
    training: dict = field(default_factory=dict)
    """objective, lora_rank, optimizer: a full training step when any differs from sft / 0 / none."""

    @property
    def is_training_step(self) -> bool:
        return is_training_step(self.training)

    @property
    def source(self) -> str:
        return SOURCE[self.device]

    def step_settings(self) -> dict:
        """What the searched step ran, as results-row fields: objective, LoRA rank, optimizer, attention
        kernel, protocol and gradients (a training step runs the default protocol, grads as
        `TrainSpec.grads` says; a backprop-only step runs --protocol and --grads)."""
        training = {"objective": "sft", "lora_rank": 0, "optimizer": "none", **self.training}
        protocol, grads = self.spec.get("protocol", "default"), self.spec.get("grads", "resident")
        if self.is_training_step:
            protocol, grads = "default", _train_spec(self.model, self.methods[0], training, self.spec).grads
        lora_rank = training["lora_rank"] or None
        attn = self.spec.get("attn", "auto")
        return {**training, "lora_rank": lora_rank, "attn": attn, "protocol": protocol, "grads": grads}


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method's search."""

    method: str
    search: SearchResult
    how: str
    """How the peak at the maximum was obtained, in words."""


def make_plan(
    model: str,
    methods: str,
    device: opt.Where,
    budget_gib: float | None,
    training: dict | None = None,
    **spec,
) -> Plan:
    """Check every input (ConfigError, one line) and resolve the device, the budget and the method list."""
    chosen = METHODS if methods.strip() == "all" else opt.split_list(methods)
    if not chosen:
        raise ConfigError("give at least one method, or 'all'")
    for method in chosen:
        check_method(method)
    ProbeSpec(model=model, method=chosen[0], **spec)  # validates sizes, dtype, grads, protocol
    training = training or {}
    if training:
        _train_spec(model, chosen[0], training, spec)  # validates objective, LoRA rank, optimizer
    _check_step_options(training, spec)
    config = load_config(model)
    where = device.value
    if where == "auto":
        where = "cuda" if cuda_available() else "sim"
    if where == "cuda" and not cuda_available():
        raise ConfigError("--device cuda: no CUDA device is available; use --device sim to simulate")
    info = device_info() if where == "cuda" else None
    if budget_gib is None:
        budget_gib = info.total_gib if info else 80.0
    if budget_gib <= 0:
        raise ConfigError(f"--budget-gib must be positive, got {budget_gib}")
    needed = weights_and_grads_bytes(config, spec.get("dtype", "bfloat16"))
    if training.get("lora_rank"):  # frozen base weights: no gradients to hold for them
        needed //= 2
    if needed >= budget_gib * GIB:
        raise ConfigError(
            f"budget {budget_gib:g} GiB is below the weights + grads of {model} ({needed / GIB:.2f} GiB in "
            f"{spec.get('dtype', 'bfloat16')}): no sequence length fits"
        )
    name = info.name if info else ("meta" if where == "sim" else platform.processor() or platform.machine())
    return Plan(
        model=model,
        methods=tuple(chosen),
        device=where,
        device_name=name,
        budget_bytes=int(budget_gib * GIB),
        weights_grads_bytes=needed,
        num_layers=config.num_hidden_layers,
        spec=spec,
        training=training,
    )


def run_plan(plan: Plan, on_probe: Callable[[str, ProbeResult, int, int | None], None]) -> list[MethodResult]:
    """Search every method of the plan; `on_probe(method, result, ok_len, fail_len)` after each probe.

    Simulated: `simulated_max_len` (depth-extrapolated search, confirmed at full depth). Measured: a
    depth-extrapolated simulated search first, then the measured probes start at its bracket.
    """
    results = []
    for method in plan.methods:
        report = functools.partial(on_probe, method)
        spec = ProbeSpec(model=plan.model, method=method, **plan.spec)
        if plan.is_training_step:
            search = _training_search(plan, method, report)
        elif plan.device == "sim":
            search = simulated_max_len(spec, plan.budget_bytes, report)
        else:
            guide = max_trainable_length(simulated_probe(spec), plan.budget_bytes, on_probe=report)
            probe = cuda_probe(spec, plan.budget_bytes) if plan.device == "cuda" else cpu_probe(spec)
            start, second = max(guide.max_len_tokens, 2), guide.bracket[1]
            search = max_trainable_length(
                probe, plan.budget_bytes, start=start, second_len=second, on_probe=report
            )
        best = search.peak_at_max
        how = best.message if best is not None and plan.device == "sim" else plan.source
        if plan.is_training_step and best is not None:
            how = f"{how}; {_training_words(plan.training)}"
        results.append(MethodResult(method=method, search=search, how=how))
    return results


def is_training_step(training: dict) -> bool:
    """Whether objective, lora_rank and optimizer ask for a full training step (not sft / 0 / none)."""
    return training not in ({}, {"objective": "sft", "lora_rank": 0, "optimizer": "none"})


def _check_step_options(training: dict, spec: dict) -> None:
    """--protocol and --grads size the backprop-only step; a training step has its own (ConfigError)."""
    protocol, grads = spec.get("protocol", "default"), spec.get("grads", "resident")
    if is_training_step(training) and (protocol != "default" or grads != "resident"):
        raise ConfigError("--protocol and --grads apply to the backprop-only step; with --objective, "
                          "--lora-rank or --optimizer the step runs the default protocol and the optimizer "
                          "decides the gradients: leave them at their defaults")


def _train_spec(model: str, method: str, training: dict, spec: dict) -> TrainSpec:
    shared = ("batch_size", "dtype", "partition_size", "head_partition_size")
    sizes = {k: spec[k] for k in shared if k in spec}
    return TrainSpec(model=model, method=method, **training, **sizes)


def _training_search(plan: Plan, method: str, report) -> SearchResult:
    """A full training step (objective, LoRA, optimizer): simulated only."""
    if plan.device != "sim":
        raise ConfigError("--objective/--lora-rank/--optimizer are simulated only for now: use --device sim")
    probe = simulated_training_probe(_train_spec(plan.model, method, plan.training, plan.spec))
    return max_trainable_length(probe, plan.budget_bytes, on_probe=report)


def _training_words(training: dict) -> str:
    lora = f"LoRA rank {training['lora_rank']}" if training["lora_rank"] else "full parameters"
    return f"objective {training['objective']}, {lora}, optimizer {training['optimizer']}"
