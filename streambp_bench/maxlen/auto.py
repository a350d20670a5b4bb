"""What `max-len` adds with `--ps auto` / `--ps-head auto`, `--gpu-model` and `--at`.

- Automatic partitions: the specs read AUTO (`config.AUTO`). A length is reachable when the smallest
  partitions the automatic choice considers fit (64 tokens: peaks only grow with a partition), so the
  search runs with those (`step.search.partitions.searched`); at each method's maximum the partitions that
  reach it are the largest that still fit there (`step.search.partitions.resolve_partitions`). Rows and the
  trainer call carry those sizes.
- `--at T,...`: for each length, per method, the largest partitions that fit (the fastest, by the
  paper's advice: fewer and larger chunks), or that nothing fits.
- `--gpu-model`: the estimated step time (`step.estimate.step_estimate.estimate_step`, labelled estimated) at
  each method's maximum and at each `--at` length, with its band (`StepEstimate.band_s`) and regime
  (`StepEstimate.regime`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from rich.table import Table

from streambp_bench.maxlen.plan import MethodResult, Plan
from streambp_core.config import MIN_AUTO_PARTITION, ConfigError, StepSpec


@dataclass(frozen=True, kw_only=True)
class Extras:
    """The options of this module beside the specs' own AUTO partitions: the GPU model, the `--at`
    lengths."""

    gpu: object | None = None
    """A `step.estimate.roofline.GpuModel`, or None."""
    at_lengths: tuple[int, ...] = ()


def automatic(plan: Plan) -> tuple[str, ...]:
    """The partition fields the plan's steps leave to the automatic choice (`StreamConfig.automatic`;
    max-len's options give every step the same partitions)."""
    return plan.specs[0].stream.automatic


def active(plan: Plan, extras: Extras) -> bool:
    """Whether this module adds to the report: automatic partitions, a GPU model or `--at` lengths."""
    return bool(automatic(plan)) or extras.gpu is not None or bool(extras.at_lengths)


@dataclass(frozen=True, kw_only=True)
class StepAt:
    """One method at one length: the spec that runs there (None: nothing fits) and its estimated time."""

    method: str
    seq_len_tokens: int
    spec: StepSpec | None
    estimated_ms: float | None = None
    band_ms: tuple[float, float] | None = None
    """The range the real step should lie in (`StepEstimate.band_s`); None when not estimated."""
    regime: str = ""
    """What bounds the estimated step ('attention-bound', `StepEstimate.regime`); empty when not estimated."""
    label: str = ""
    """The method's row label ('streambp + offload'); the method's name when empty."""
    pcie: dict | None = None
    """With offload: the copies' bytes each way, the PCIe bandwidth assumed, their whole time and the part
    compute does not hide (`copies_of`)."""
    all_to_all_gib: float | None = None
    """A sequence-parallel rank's all-to-all bytes per step (GiB sent), estimated; None without --sp."""
    interconnect: str = ""
    """The links the collectives' time assumes, in words (empty without --sp)."""

    def to_dict(self) -> dict:
        spec = self.spec
        sizes = {} if spec is None or not spec.partitioned else {
            "partition_size": spec.stream.partition_size,
            "head_partition_size": spec.stream.head_partition_size}
        pcie = {} if self.pcie is None else {"estimated_pcie": self.pcie}
        return {"method": self.method, "label": self.label or self.method,
                "seq_len_tokens": self.seq_len_tokens, "fits": spec is not None,
                **sizes, "estimated_step_time_ms": self.estimated_ms,
                "estimated_step_time_band_ms": None if self.band_ms is None else list(self.band_ms),
                "estimated_regime": self.regime or None, **pcie,
                **({} if self.all_to_all_gib is None else {"estimated_all_to_all_gib": self.all_to_all_gib,
                                                           "interconnect": self.interconnect})}


def copies_of(estimate) -> dict | None:
    """The offload copies of a `step.estimate.roofline.StepEstimate` (None without any): bytes each way, the
    PCIe bandwidth assumed (one direction, the GPU's), their whole time (both directions' bytes over it) and
    the part the step's compute does not hide (in the step time)."""
    if not estimate.pcie_bytes_per_s:
        return None
    return {"to_host_bytes": estimate.to_host_bytes, "to_device_bytes": estimate.to_device_bytes,
            "pcie_gb_per_s": estimate.pcie_bytes_per_s / 1e9, "copy_ms": 1e3 * estimate.copy_s,
            "not_hidden_ms": 1e3 * estimate.transfer_s}


def finish(plan: Plan, results: list[MethodResult],
           extras: Extras) -> tuple[list[MethodResult], list[StepAt]]:
    """(results with the partitions reaching each maximum, one StepAt per method at its maximum and at
    each `--at` length)."""
    from streambp_core.step.search.partitions import searched

    finished, steps = [], []
    for result in results:
        at_max = _step_at(plan, result.spec, result.search.max_len_tokens, extras)
        finished.append(replace(result, spec=at_max.spec or searched(result.spec)))
        lengths = [_step_at(plan, result.spec, length, extras) for length in extras.at_lengths]
        steps += [replace(step, label=result.label) for step in (at_max, *lengths)]
    return finished, steps


def _step_at(plan: Plan, spec: StepSpec, seq_len: int, extras: Extras) -> StepAt:
    from streambp_core.step.estimate.step_estimate import estimate_step
    from streambp_core.step.search.partitions import resolve_partitions
    from streambp_core.step.simulation.simulate import simulate

    if seq_len < 2:
        return StepAt(method=spec.method, seq_len_tokens=seq_len, spec=None)
    try:
        run = resolve_partitions(spec.at(seq_len), plan.budget_bytes, plan.resolved)
    except ConfigError:  # not even the smallest partitions fit
        return StepAt(method=spec.method, seq_len_tokens=seq_len, spec=None)
    chosen = spec.partitioned and bool(spec.stream.automatic)  # checked at full depth by the choice
    full = simulate(run, plan.resolved, depth="full") if not chosen else None
    if full is not None and full.peak_bytes > plan.budget_bytes:
        return StepAt(method=spec.method, seq_len_tokens=seq_len, spec=None)
    if extras.gpu is None:
        return StepAt(method=spec.method, seq_len_tokens=seq_len, spec=run)
    estimate = estimate_step(run, extras.gpu, plan.resolved)
    sent = estimate.all_to_all_bytes
    low_s, high_s = estimate.band_s
    return StepAt(method=spec.method, seq_len_tokens=seq_len, spec=run, estimated_ms=estimate.step_time_ms,
                  band_ms=(1e3 * low_s, 1e3 * high_s), regime=estimate.regime, pcie=copies_of(estimate),
                  all_to_all_gib=None if sent is None else sent / 2**30, interconnect=estimate.interconnect)


def to_dict(steps: list[StepAt], extras: Extras, automatic: tuple[str, ...] = ()) -> dict:
    """The JSON entries of this module (added to max-len's document); `automatic`: the partition fields
    the steps left to the automatic choice (`automatic(plan)`)."""
    return {"partitions": {"layer": "auto" if "partition_size" in automatic else "given",
                           "head": "auto" if "head_partition_size" in automatic else "given"},
            "gpu_model": None if extras.gpu is None else extras.gpu.name,
            "steps": [step.to_dict() for step in steps]}


def render_table(steps: list[StepAt], extras: Extras, automatic: tuple[str, ...] = ()) -> Table:
    """Per method and length: the partitions that run there and the estimated step time; `automatic` as
    in `to_dict`."""
    gpu = "" if extras.gpu is None else (f"; step time estimated for {extras.gpu.name}, with the band the "
                                         "published steps lie in")
    searched = f" (the search ran with {MIN_AUTO_PARTITION}-token partitions, which reach furthest)" if (
        automatic) else ""
    copies = [step.pcie for step in steps if step.pcie is not None]
    if copies:
        gpu += (f"; offload copies over PCIe at {copies[0]['pcie_gb_per_s']:g} GB/s one way (both "
                "directions' bytes counted on it; in the step time, only what compute does not hide)")
    links = next((step.interconnect for step in steps if step.interconnect), "")
    links = f"; all-to-alls at {links}, not overlapped" if links else ""
    title = f"partitions that fit (largest = fastest){searched}{gpu}{links}"
    table = Table(title=title, title_justify="left")
    pcie_columns = ("GiB to host / to device", "PCIe s", "not hidden s") if copies else ()
    sequence = any(step.all_to_all_gib is not None for step in steps)
    estimated = ("est. step s", "band s", "regime") if extras.gpu is not None else ("est. step s",)
    for column in ("method", "length", "partition", "head partition", *estimated, *pcie_columns,
                   *(("all-to-all GiB sent",) if sequence else ())):
        table.add_column(column, justify="left" if column == "method" else "right")
    for step in steps:
        spec = step.spec
        sizes = ("-", "-") if spec is None or not spec.partitioned else (
            f"{spec.stream.partition_size:,}", f"{spec.stream.head_partition_size:,}")
        fits = "" if spec is not None else " (does not fit)"
        sent = ("-" if step.all_to_all_gib is None else f"{step.all_to_all_gib:,.0f}",) if sequence else ()
        pcie = _pcie_cells(step.pcie) if copies else ()
        table.add_row(step.label or step.method, f"{step.seq_len_tokens:,}{fits}", *sizes,
                      *_estimate_cells(step, len(estimated)), *pcie, *sent)
    return table


def _estimate_cells(step: StepAt, columns: int) -> tuple[str, ...]:
    """The estimated step time, then (`columns` 3) its band and regime; '-' where not estimated."""
    band = "-" if step.band_ms is None else f"{step.band_ms[0] / 1e3:,.2f}-{step.band_ms[1] / 1e3:,.2f}"
    return (step_seconds(step.estimated_ms), band, step.regime or "-")[:columns]


def _pcie_cells(pcie: dict | None) -> tuple[str, str, str]:
    if pcie is None:
        return ("-", "-", "-")
    gib = 2**30
    return (f"{pcie['to_host_bytes'] / gib:.1f} / {pcie['to_device_bytes'] / gib:.1f}",
            f"{pcie['copy_ms'] / 1e3:.2f}", f"{pcie['not_hidden_ms'] / 1e3:.2f}")


def step_seconds(step_ms: float | None) -> str:
    """An estimated step time as the table shows it: seconds, and hours too past one hour."""
    if step_ms is None:
        return "-"
    hours = f" ({step_ms / 3.6e6:.1f} h)" if step_ms >= 3.6e6 else ""
    return f"{step_ms / 1e3:,.2f}{hours}"


def estimated_rows(steps: list[StepAt], extras: Extras) -> list:
    """One `step_time` row (source estimated, device the GPU's name) per step that fits and was estimated."""
    from streambp_bench.results import ResultRow, provenance, spec_fields

    if extras.gpu is None:
        return []
    stamp = provenance("estimated", extras.gpu.name)
    return [ResultRow(**spec_fields(step.spec), **stamp, metric="step_time", value=step.estimated_ms)
            for step in steps if step.spec is not None and step.estimated_ms is not None]


def gpu(name: str):
    """The `step.estimate.roofline.GpuModel` named `name`."""
    from streambp_core.step.estimate.roofline import gpu_model

    return gpu_model(name)
