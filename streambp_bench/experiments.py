"""Grid points of a sweep: parse and expand the grid, run one point, write its rows, resume.

A `Point` is one training step's settings (method, model, objective, length, batch, partition sizes,
dtype, LoRA rank, optimizer, attention kernel). `run_point(point, where)` turns it into result rows:
- where "sim": the peak simulated on meta tensors (`simulate_step` for plain SFT backprop, else
  `simulate_training_step`); a peak above the budget is status "oom" (value empty, peak kept);
- where "cpu" / "cuda": a real step (`measure_training_step`): the tracked (CPU) or allocator (CUDA)
  peak (on CUDA with the reserved peak, alloc retries and OOM count), and a second row, metric
  step_time, with the median of the timed repeats.
Every row records the step's protocol ("default") and gradients (`TrainSpec.grads`: fresh with an
optimizer, else resident), and the attention kernel asked for (a simulation uses its flash-like fake
kernel whatever it is).
`run_points` writes each point's rows as soon as it finishes (atomic upsert), so Ctrl-C or a kill
loses no finished point, and skips points already in the file unless `force` (resume).
"""

from __future__ import annotations

import itertools
import platform
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, replace

from streambp_bench.results import ResultRow, ResultsFile, allocator_columns, provenance
from streambp_core.config import ConfigError
from streambp_core.measure.cuda import cuda_available, device_info, is_oom
from streambp_core.measure.simulate import simulate_step
from streambp_core.measure.training_step import TrainSpec, measure_training_step, simulate_training_step
from streambp_core.measure.units import GIB
from streambp_core.models import load_config

PARTITIONED = ("streambp", "mst")
"""Methods that take partition sizes; the others get empty partition cells."""
SOURCE = {"sim": "simulated", "cpu": "measured-cpu", "cuda": "measured-cuda"}
MEASURE_REPEATS = 5
"""Timed steps per measured point (after one warm-up); the median is its step time."""
DEFAULT_BUDGET_GIB = 80.0
"""Budget a simulated point is judged against without a GPU (the paper's A800-80GB)."""


@dataclass(frozen=True, kw_only=True)
class Point:
    """One grid point: a training step's settings."""

    method: str
    model: str
    seq_len_tokens: int
    objective: str = "sft"
    batch_size: int = 1
    partition_size: int | None = 500
    head_partition_size: int | None = 100
    dtype: str = "bfloat16"
    lora_rank: int = 0
    optimizer: str = "none"
    attn: str = "auto"
    """Attention kernel on CUDA: auto, sdpa or flash."""

    def spec(self) -> TrainSpec:
        """The step as a `TrainSpec` (validates every field; ConfigError)."""
        return TrainSpec(
            model=self.model,
            method=self.method,
            objective=self.objective,
            lora_rank=self.lora_rank,
            optimizer=self.optimizer,
            batch_size=self.batch_size,
            dtype=self.dtype,
            partition_size=self.partition_size or 500,
            head_partition_size=self.head_partition_size or 100,
            attn=self.attn,
        )

    def key_fields(self) -> dict:
        """The point's KEY_COLUMNS values (without source, metric and device)."""
        return {
            "method": self.method,
            "model": self.model,
            "objective": self.objective,
            "seq_len_tokens": self.seq_len_tokens,
            "batch_size": self.batch_size,
            "partition_size": self.partition_size,
            "head_partition_size": self.head_partition_size,
            "dtype": self.dtype,
            "lora_rank": self.lora_rank or None,
            "optimizer": self.optimizer,
            "attn": self.attn,
            "protocol": "default",
            "grads": self.spec().grads,
        }


@dataclass(frozen=True, kw_only=True)
class Where:
    """Where points run: 'sim', 'cpu' or 'cuda', the device's name and the memory budget (GiB)."""

    device: str
    device_name: str
    budget_gib: float | None

    @property
    def source(self) -> str:
        return SOURCE[self.device]

    def metrics(self) -> tuple[str, ...]:
        return ("peak_memory",) if self.device == "sim" else ("peak_memory", "step_time")


def resolve_where(device: str, budget_gib: float | None = None) -> Where:
    """'auto' -> cuda when present, else sim; the device's name; the budget (GPU total, else 80 GiB)."""
    if device not in ("auto", *SOURCE):
        raise ConfigError(f"device must be auto, cuda, cpu or sim, got {device!r}")
    if device == "auto":
        device = "cuda" if cuda_available() else "sim"
    if device == "cuda" and not cuda_available():
        raise ConfigError("--device cuda: no CUDA device is available; use --device sim to simulate")
    if budget_gib is not None and budget_gib <= 0:
        raise ConfigError(f"--budget-gib must be positive, got {budget_gib}")
    if device == "cuda":
        info = device_info()
        return Where(device="cuda", device_name=info.name, budget_gib=budget_gib or info.total_gib)
    if device == "cpu":
        return Where(
            device="cpu", device_name=platform.processor() or platform.machine(), budget_gib=budget_gib
        )
    return Where(device="sim", device_name="meta", budget_gib=budget_gib or DEFAULT_BUDGET_GIB)


_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)([kK]?)$")


def parse_tokens(text: str, what: str = "length") -> int:
    """'4096' -> 4096, '4k' -> 4096, '1.5k' -> 1536 (k = 1024); ConfigError otherwise."""
    match = _NUMBER.match(text.strip())
    if not match:
        raise ConfigError(f"bad {what} {text!r}: use an integer, optionally with a k suffix (4k = 4096)")
    value = float(match.group(1)) * (1024 if match.group(2) else 1)
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
            values.extend(range(start, stop + 1, step))
        else:
            values.append(parse_tokens(item, what))
    if not values:
        raise ConfigError(f"give at least one {what}")
    return tuple(dict.fromkeys(values))


def expand_grid(
    *,
    methods: Sequence[str],
    models: Sequence[str],
    seq_lens: Sequence[int],
    partition_sizes: Sequence[int] = (500,),
    head_partition_size: int = 100,
    **common: object,
) -> list[Point]:
    """Every combination, in model, method, partition size, length order; methods without partitions
    get one point per length (empty partition cells), not one per partition size. Validates each."""
    points: list[Point] = []
    for model, method in itertools.product(models, methods):
        sizes: Iterable[int | None] = partition_sizes if method in PARTITIONED else (None,)
        head = head_partition_size if method in PARTITIONED else None
        for size, length in itertools.product(sizes, seq_lens):
            points.append(
                Point(
                    method=method,
                    model=model,
                    seq_len_tokens=length,
                    partition_size=size,
                    head_partition_size=head,
                    **common,
                )  # type: ignore[arg-type]
            )
    for point in points:
        if point.seq_len_tokens < 2:
            raise ConfigError(f"seq_len must be >= 2, got {point.seq_len_tokens}")
        point.spec()
    for model in dict.fromkeys(models):
        load_config(model)
    return list(dict.fromkeys(points))


def point_keys(point: Point, where: Where) -> set[tuple[str, ...]]:
    """The keys of the rows `run_point(point, where)` writes."""
    extra = {"source": where.source, "device_name": where.device_name}
    return {ResultRow.key_of(**point.key_fields(), **extra, metric=m) for m in where.metrics()}


def run_point(point: Point, where: Where) -> list[ResultRow]:
    """Run one point (simulated or measured, see the module docstring) and return its rows."""
    base = {
        **point.key_fields(),
        **provenance(where.source, where.device_name),
        "budget_gib": where.budget_gib,
    }
    try:
        if where.device == "sim":
            return [_simulated_row(point, base, where.budget_gib)]
        measured = measure_training_step(
            point.spec(), point.seq_len_tokens, where.device, repeats=MEASURE_REPEATS
        )
    except Exception as error:  # an OOM is a data point; any other failure is recorded as an error row
        status = "oom" if is_oom(error) else "error"
        message = " ".join(str(error).split())[:300]
        return [ResultRow(**base, metric=m, status=status, error=message) for m in where.metrics()]
    columns = _columns(measured.peak_bytes, measured.breakdown_bytes)
    row = ResultRow(
        **base,
        **columns,
        metric="peak_memory",
        value=columns["peak_allocated_gib"],
        step_time_ms=measured.step_time_ms,
        **allocator_columns(measured),
    )
    return [row, replace(row, metric="step_time", value=measured.step_time_ms)]


def _simulated_row(point: Point, base: dict, budget_gib: float | None) -> ResultRow:
    spec = point.spec()
    plain_backprop = (spec.objective, spec.lora_rank, spec.optimizer) == ("sft", 0, "none")
    if plain_backprop:
        sim = simulate_step(
            spec.model,
            spec.method,
            point.seq_len_tokens,
            batch_size=spec.batch_size,
            dtype=spec.dtype,
            partition_size=spec.partition_size,
            head_partition_size=spec.head_partition_size,
        )
    else:
        sim = simulate_training_step(spec, point.seq_len_tokens)
    columns = _columns(sim.peak_bytes, sim.breakdown_bytes)
    fits = budget_gib is None or sim.peak_bytes <= budget_gib * GIB
    return ResultRow(
        **base,
        **columns,
        metric="peak_memory",
        status="ok" if fits else "oom",
        value=columns["peak_allocated_gib"] if fits else None,
    )


def _columns(peak_bytes: int, breakdown_bytes: dict[str, int]) -> dict[str, float]:
    by_category = {f"{name}_gib": value / GIB for name, value in breakdown_bytes.items()}
    return {"peak_allocated_gib": peak_bytes / GIB, **by_category}


def run_points(
    points: Sequence[Point],
    where: Where,
    results: ResultsFile,
    *,
    force: bool = False,
    on_point: Callable[[Point, list[ResultRow] | None], None] | None = None,
) -> list[ResultRow]:
    """Run the points not yet in `results` (all of them when `force`), upserting each one's rows at once.

    `on_point(point, rows)` is called after each point (rows None for a point skipped as done).
    Returns the rows written. A KeyboardInterrupt propagates after the finished points are on disk.
    """
    done = set() if force else {row.key() for row in results.rows() if row.status != "error"}
    written: list[ResultRow] = []
    for point in points:
        if point_keys(point, where) <= done:
            if on_point is not None:
                on_point(point, None)
            continue
        rows = run_point(point, where)
        results.append_many(rows)
        written.extend(rows)
        if on_point is not None:
            on_point(point, rows)
    return written
