"""The sweep grid: expand it into points, run one point, write its rows, resume.

A point is one training step: a `StepSpec` (method, model, objective, length, batch, partition sizes,
dtype, LoRA rank, optimizer, attention kernel, protocol, gradients). `run_point(spec, target)` turns it
into result rows:
- on "sim": the peak simulated on meta tensors with every layer (`step.simulation.simulate.simulate` at
  `depth="full"`: a row reports a peak, which an extrapolation in depth may under-estimate, and one
  sharded rank's may over-estimate, so no row is left unconfirmed); a peak above the budget is status
  "oom" (value empty, peak kept);
- on "cpu" / "cuda": a real step (`step.search.probe.measure_setup` for the tracked or allocator peak, on CUDA
  with the reserved peak, alloc retries and OOM count), then timed steps (`step.run.timing.time_step`): a
  second row, metric step_time, with the median and the p20/p80 of the repeats.
- with a GPU model (`gpu`): a row more, metric step_time, source "estimated", device the GPU's name:
  the roofline estimate of the step (`step.estimate.step_estimate.estimate_step`); empty with the peak row's
  status when the point does not fit.
`run_points` writes each point's rows as soon as it finishes (appended: a point costs its own bytes, not
the file's; a re-run point rewrites the file atomically), so Ctrl-C or a kill
loses no finished point, and skips points already in the file unless `force` (resume). Its `resolve`
turns a point into the one to run (automatic partition sizes), before the resume check: rows record
the sizes that ran.
"""

from __future__ import annotations

import itertools
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
from streambp_bench.tokens import check_count
from streambp_core.config import StepSpec

MEASURE_REPEATS = 5
"""Timed steps per measured point (after one warm-up); the median is its step time."""


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
    check_count(len(models) * len(methods) * len(partition_sizes) * len(seq_lens), "the grid",
                 "fewer models, methods, partition sizes or lengths")
    points: list[StepSpec] = []
    for model, method in itertools.product(models, methods):
        sizes = partition_sizes if StepSpec(model=model, method=method).partitioned else partition_sizes[:1]
        for size, length in itertools.product(sizes, seq_lens):
            points.append(StepSpec.of(model=model, method=method, seq_len_tokens=length, partition_size=size,
                                      **common))  # type: ignore[arg-type]
    return list(dict.fromkeys(points))


def estimate_key(spec: StepSpec, gpu) -> tuple[str, ...]:
    """The key of the estimated step_time row of `spec` on `gpu` (a `step.estimate.roofline.GpuModel`)."""
    return ResultRow.key_of(**spec_fields(spec), source="estimated", device_name=gpu.name, metric="step_time")


def estimated_row(spec: StepSpec, gpu, peak_row: ResultRow, model=None) -> ResultRow:
    """The estimated step_time row of `spec` on `gpu` (ms in `value`), given the point's peak row; `model`:
    the spec's model resolved once (`step.parts.resolved.ResolvedModel`; None: resolved here)."""
    from streambp_core.step.estimate.step_estimate import estimate_step

    fields = {**spec_fields(spec), **provenance("estimated", gpu.name), "metric": "step_time"}
    if peak_row.status != "ok":
        return ResultRow(**fields, status=peak_row.status, error=peak_row.error or "the step does not fit")
    return ResultRow(**fields, value=estimate_step(spec, gpu, model).step_time_ms)


def metrics(target) -> tuple[str, ...]:
    """The metrics a point writes: the peak; measured points also the step time."""
    return ("peak_memory",) if target.device == "sim" else ("peak_memory", "step_time")


def point_keys(spec: StepSpec, target) -> set[tuple[str, ...]]:
    """The keys of the rows `run_point(spec, target)` writes."""
    extra = {"source": target.source, "device_name": target.device_name}
    return {ResultRow.key_of(**spec_fields(spec), **extra, metric=m) for m in metrics(target)}


def run_point(spec: StepSpec, target, model=None) -> list[ResultRow]:
    """Run one point (simulated or measured, see the module docstring) and return its rows; `model` is the
    spec's model when the caller resolved it (`step.parts.resolved.ResolvedModel`)."""
    from streambp_core.measure.cuda import is_oom

    base = {**spec_fields(spec), **provenance(target.source, target.device_name),
            "budget_gib": target.budget_gib}
    try:
        if target.device == "sim":
            return [_simulated_row(spec, base, target, model)]
        probe, timing = _measured(spec, target.device, model)
    except Exception as error:  # an OOM is a data point; any other failure is recorded as an error row
        status = "oom" if is_oom(error) else "error"
        message = " ".join(str(error).split())[:300]
        return [ResultRow(**base, metric=m, status=status, error=message) for m in metrics(target)]
    row = ResultRow(**base, **memory_columns(probe.peak_bytes, probe.breakdown_bytes), metric="peak_memory",
                    value=probe.peak_bytes / 2**30, **allocator_columns(probe), **host_columns(probe),
                    **timing.columns(counters=False))
    return [row, replace(row, metric="step_time", value=timing.p50_ms)]


def _measured(spec: StepSpec, device: str, model):
    """A tracked step on real tensors (the peak), then `MEASURE_REPEATS` timed steps after a warm-up."""
    from streambp_core.step.parts.resolved import resolved
    from streambp_core.step.run.setup import build_setup
    from streambp_core.step.run.timing import timed_step
    from streambp_core.step.search.probe import cpu_ram_refusal, measure_setup

    model = resolved(spec.model, model)
    if device == "cpu" and (refusal := cpu_ram_refusal(spec, model)) is not None:
        raise MemoryError(f"not run: {refusal}")  # an oom row: RAM is a CPU step's device memory
    setup = build_setup(spec, model.config, device)
    probe = measure_setup(setup, device)
    if probe.status != "ok":
        raise MemoryError(probe.message or "out of memory")
    return probe, timed_step(setup, device, repeats=MEASURE_REPEATS)


def _simulated_row(spec: StepSpec, base: dict, target, model) -> ResultRow:
    from streambp_core.step.simulation.simulate import simulate

    sim = simulate(spec, model, depth="full")
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
    `resolve(point, model)` gives the point to run (module docstring); `gpu` adds the estimated row. Each
    model is resolved once (`step.parts.resolved.ResolvedModel`: its config and the simulation memo its points
    share). A KeyboardInterrupt propagates after the finished points are on disk.
    """
    from streambp_core.step.parts.resolved import ResolvedModel

    models = {name: ResolvedModel(name) for name in dict.fromkeys(p.model for p in points)}
    done = set() if force else {row.key() for row in results.rows() if finished(row, target)}
    written: list[ResultRow] = []
    for point in points:
        model = models[point.model]
        point = point if resolve is None else resolve(point, model)
        keys = point_keys(point, target) | (set() if gpu is None else {estimate_key(point, gpu)})
        if keys <= done:
            if on_point is not None:
                on_point(point, None)
            continue
        rows = [_no_value_is_an_error(row) for row in run_point(point, target, model)]
        if gpu is not None:
            rows.append(estimated_row(point, gpu, rows[0], model))
        results.append_many(rows)
        written.extend(rows)
        if on_point is not None:
            on_point(point, rows)
    return written
