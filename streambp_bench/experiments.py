"""Grid points of a sweep: parse and expand the grid, run one point, write its rows, resume.

A point is one training step: a `StepSpec` (method, model, objective, length, batch, partition sizes,
dtype, LoRA rank, optimizer, attention kernel, protocol, gradients). `run_point(spec, target)` turns it
into result rows:
- on "sim": the peak simulated on meta tensors (`step.simulate.simulate`); a peak above the budget is
  status "oom" (value empty, peak kept);
- on "cpu" / "cuda": a real step (`step.probe.measure_setup` for the tracked or allocator peak, on CUDA
  with the reserved peak, alloc retries and OOM count), then timed steps (`step.timing.time_step`): a
  second row, metric step_time, with the median and the p20/p80 of the repeats.
- with a GPU model (`gpu`): a row more, metric step_time, source "estimated", device the GPU's name:
  the roofline estimate of the step (`step.estimate.estimate_step`); empty with the peak row's status
  when the point does not fit.
`run_points` writes each point's rows as soon as it finishes (atomic upsert), so Ctrl-C or a kill
loses no finished point, and skips points already in the file unless `force` (resume). Its `resolve`
turns a point into the one to run (automatic partition sizes), before the resume check: rows record
the sizes that ran.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Callable, Sequence
from dataclasses import replace

from streambp_bench.results import (
    ResultRow,
    ResultsFile,
    allocator_columns,
    host_columns,
    memory_columns,
    provenance,
    spec_fields,
)
from streambp_core.config import ConfigError, StepSpec

MEASURE_REPEATS = 5
"""Timed steps per measured point (after one warm-up); the median is its step time."""


MAX_GRID_POINTS = 10_000
"""Most points one sweep runs (and most values one list or range expands to): a larger grid is a typo
(a STEP of 1 token), refused before it is built."""

_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)(k|ki)?$", re.IGNORECASE)
SUFFIXES = {"": 1, "k": 1000, "ki": 1024}
"""Token-count suffixes: k = 1000 (the paper's unit, as on every plot axis and table), ki = 1024."""


def parse_tokens(text: str, what: str = "length") -> int:
    """'4096' -> 4096, '4k' -> 4000, '1.5k' -> 1500, '4ki' -> 4096 (`SUFFIXES`); ConfigError otherwise."""
    match = _NUMBER.match(text.strip())
    if not match:
        raise ConfigError(f"bad {what} {text!r}: use an integer, optionally with a k suffix "
                          "(k = 1000: 4k = 4000; ki = 1024: 4ki = 4096)")
    value = float(match.group(1)) * SUFFIXES[(match.group(2) or "").lower()]
    if not value.is_integer() or value < 1:
        raise ConfigError(f"bad {what} {text!r}: must be a positive whole number of tokens")
    return int(value)


def parse_token_list(text: str, what: str = "length") -> tuple[int, ...]:
    """A comma list of token counts and/or ranges START:STOP:STEP (inclusive), e.g. '1k,4k:16k:4k'."""
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if ":" in item:
            parts = item.split(":")
            if len(parts) != 3:
                raise ConfigError(f"bad {what} range {item!r}: use START:STOP:STEP, e.g. 4k:64k:4k")
            start, stop, step = (parse_tokens(part, what) for part in parts)
            if stop < start:
                raise ConfigError(f"bad {what} range {item!r}: STOP is below START")
            _check_count(len(values) + len(range(start, stop + 1, step)), f"{what} list {text!r}")
            values.extend(range(start, stop + 1, step))
        else:
            values.append(parse_tokens(item, what))
    if not values:
        raise ConfigError(f"give at least one {what}")
    return tuple(dict.fromkeys(values))


def _check_count(count: int, what: str, hint: str = "use a larger STEP") -> None:
    """ConfigError when `what` has more than MAX_GRID_POINTS values."""
    if count > MAX_GRID_POINTS:
        raise ConfigError(f"{what} has {count:,} points; a sweep runs at most {MAX_GRID_POINTS:,} ({hint})")


def expand_grid(
    *,
    methods: Sequence[str],
    models: Sequence[str],
    seq_lens: Sequence[int],
    partition_sizes: Sequence[int] = (500,),
    **common: object,
) -> list[StepSpec]:
    """Every combination, in model, method, partition size, length order; methods without partitions get
    one point per length, not one per partition size. Each point is validated (ConfigError)."""
    _check_count(len(models) * len(methods) * len(partition_sizes) * len(seq_lens), "the grid",
                 "fewer models, methods, partition sizes or lengths")
    points: list[StepSpec] = []
    for model, method in itertools.product(models, methods):
        sizes = partition_sizes if StepSpec(model=model, method=method).partitioned else partition_sizes[:1]
        for size, length in itertools.product(sizes, seq_lens):
            points.append(StepSpec(model=model, method=method, seq_len_tokens=length, partition_size=size,
                                   **common))  # type: ignore[arg-type]
    return list(dict.fromkeys(points))


def estimate_key(spec: StepSpec, gpu) -> tuple[str, ...]:
    """The key of the estimated step_time row of `spec` on `gpu` (a `step.estimate.GpuModel`)."""
    return ResultRow.key_of(**spec_fields(spec), source="estimated", device_name=gpu.name, metric="step_time")


def estimated_row(spec: StepSpec, gpu, peak_row: ResultRow, config=None,
                  cache: dict | None = None) -> ResultRow:
    """The estimated step_time row of `spec` on `gpu` (ms in `value`), given the point's peak row."""
    from streambp_core.step.estimate import estimate_step

    fields = {**spec_fields(spec), **provenance("estimated", gpu.name), "metric": "step_time"}
    if peak_row.status != "ok":
        return ResultRow(**fields, status=peak_row.status, error=peak_row.error or "the step does not fit")
    return ResultRow(**fields, value=estimate_step(spec, gpu, config, cache).step_time_ms)


def metrics(target) -> tuple[str, ...]:
    """The metrics a point writes: the peak; measured points also the step time."""
    return ("peak_memory",) if target.device == "sim" else ("peak_memory", "step_time")


def point_keys(spec: StepSpec, target) -> set[tuple[str, ...]]:
    """The keys of the rows `run_point(spec, target)` writes."""
    extra = {"source": target.source, "device_name": target.device_name}
    return {ResultRow.key_of(**spec_fields(spec), **extra, metric=m) for m in metrics(target)}


def run_point(spec: StepSpec, target, config=None) -> list[ResultRow]:
    """Run one point (simulated or measured, see the module docstring) and return its rows; `config` is
    the model's config when the caller resolved it."""
    from streambp_core.measure.cuda import is_oom

    base = {**spec_fields(spec), **provenance(target.source, target.device_name),
            "budget_gib": target.budget_gib}
    try:
        if target.device == "sim":
            return [_simulated_row(spec, base, target, config)]
        probe, timing = _measured(spec, target.device, config)
    except Exception as error:  # an OOM is a data point; any other failure is recorded as an error row
        status = "oom" if is_oom(error) else "error"
        message = " ".join(str(error).split())[:300]
        return [ResultRow(**base, metric=m, status=status, error=message) for m in metrics(target)]
    row = ResultRow(**base, **memory_columns(probe.peak_bytes, probe.breakdown_bytes), metric="peak_memory",
                    value=probe.peak_bytes / 2**30, **allocator_columns(probe), **host_columns(probe),
                    **timing.columns(counters=False))
    return [row, replace(row, metric="step_time", value=timing.p50_ms)]


def _measured(spec: StepSpec, device: str, config):
    """A tracked step on real tensors (the peak), then `MEASURE_REPEATS` timed steps after a warm-up."""
    from streambp_core.methods import prepare
    from streambp_core.step.probe import cpu_ram_refusal, measure_setup
    from streambp_core.step.setup import build_setup, reset_grads, resolve_config
    from streambp_core.step.timing import time_step

    config = resolve_config(spec, config)
    if device == "cpu" and (refusal := cpu_ram_refusal(spec, config)) is not None:
        raise MemoryError(f"not run: {refusal}")  # an oom row: RAM is a CPU step's device memory
    setup = build_setup(spec, config, device)
    probe = measure_setup(setup, device)
    if probe.status != "ok":
        raise MemoryError(probe.message or "out of memory")
    model, optimizer = setup.model, setup.optimizer

    def step() -> None:
        reset_grads(model, spec)
        loss = run.loss(**setup.inputs)
        loss.backward()
        if optimizer is not None:
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)

    with prepare(model, spec.method, **spec.stream_options()) as run:
        timing = time_step(step, device, repeats=MEASURE_REPEATS)
    return probe, timing


def _simulated_row(spec: StepSpec, base: dict, target, config) -> ResultRow:
    from streambp_core.step.simulate import simulate

    sim = simulate(spec, config)
    fits = target.budget_bytes is None or sim.peak_bytes <= target.budget_bytes
    return ResultRow(**base, **memory_columns(sim.peak_bytes, sim.breakdown_bytes), metric="peak_memory",
                     status="ok" if fits else "oom", value=sim.peak_gib if fits else None,
                     **host_columns(sim))


def finished(row: ResultRow, target) -> bool:
    """Whether `row` answers its point for `target`, so a resumed sweep may skip it: not an error, an ok
    row with a value (a NaN or empty value is no answer), and a simulated row judged against the same
    budget (the budget decides a simulated point's ok or oom)."""
    if row.status == "error" or (row.status == "ok" and row.value is None):
        return False
    return row.source != "simulated" or row.budget_gib == target.budget_gib


def _no_value_is_an_error(row: ResultRow) -> ResultRow:
    """An ok row without a value (NaN is read as no value) becomes an error row, re-run on resume."""
    if row.status != "ok" or row.value is not None:
        return row
    return replace(row, status="error", error=row.error or f"{row.metric} has no value (NaN or empty)")


def run_points(
    points: Sequence[StepSpec],
    target,
    results: ResultsFile,
    *,
    force: bool = False,
    on_point: Callable[[StepSpec, list[ResultRow] | None], None] | None = None,
    resolve: Callable[[StepSpec, object], StepSpec] | None = None,
    gpu=None,
) -> list[ResultRow]:
    """Run the points not yet in `results` (all of them when `force`), upserting each one's rows at once.

    `on_point(point, rows)` is called after each point (rows None for a point skipped as done).
    `resolve(point, config)` gives the point to run (module docstring); `gpu` adds the estimated row. Each
    model's config is resolved once. A KeyboardInterrupt propagates after the finished points are on disk.
    """
    from streambp_core.models import load_config

    configs = {model: load_config(model) for model in dict.fromkeys(p.model for p in points)}
    done = set() if force else {row.key() for row in results.rows() if finished(row, target)}
    written: list[ResultRow] = []
    cache: dict = {}
    for point in points:
        config = configs[point.model]
        point = point if resolve is None else resolve(point, config)
        keys = point_keys(point, target) | (set() if gpu is None else {estimate_key(point, gpu)})
        if keys <= done:
            if on_point is not None:
                on_point(point, None)
            continue
        rows = [_no_value_is_an_error(row) for row in run_point(point, target, config)]
        if gpu is not None:
            rows.append(estimated_row(point, gpu, rows[0], config, cache))
        results.append_many(rows)
        written.extend(rows)
        if on_point is not None:
            on_point(point, rows)
    return written
