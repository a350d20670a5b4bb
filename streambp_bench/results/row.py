"""The results row: one dataclass is the CSV schema (one row per point and metric, DESIGN.md, Results
contract); a row's key is its point, and the columns a step, a peak or a measurement fills.

Files of rows are `streambp_bench.results.file`; rows from a file of an older schema are completed by
`schema_history`; where a row came from is `versions.provenance`.
"""

from __future__ import annotations

import math
import operator
import typing
from collections.abc import Iterable
from dataclasses import MISSING, asdict, dataclass, fields
from typing import TYPE_CHECKING

from streambp_bench.errors import SchemaError
from streambp_core.config import (
    ATTN_BACKENDS,
    GRADS_MODES,
    HEAD_MODES,
    OFFLOAD_MODES,
    PROTOCOLS,
    SHARD_MODES,
    StepSpec,
)
from streambp_core.tiers import OFFLOAD_TIERS, Tiers

if TYPE_CHECKING:  # pandas is imported where a frame is built: writing rows does not need it
    import pandas as pd

SOURCES = ("simulated", "measured-cuda", "measured-cpu", "estimated")
STATUSES = ("ok", "oom", "error")
METRICS = ("peak_memory", "step_time", "max_len", "grad_rel_err")
"""Known metrics; `value` is GiB, milliseconds, tokens and a relative error respectively."""
RESOLVED_HEAD_MODES = tuple(mode for mode in HEAD_MODES if mode != "auto")
"""The head modes a streambp row records: what ran (auto is resolved by `StepSpec`)."""
CATEGORY_COLUMNS = tuple(
    f"{name}_gib"
    for name in "weights grads optimizer checkpoints kv logits temporaries kernel_workspace".split()
)




@dataclass(frozen=True, kw_only=True)
class ResultRow:
    """One point and metric, one field per CSV column (None = empty cell; GiB = 2**30 bytes; ms)."""

    method: str
    """plain, checkpoint, mst or streambp."""
    model: str
    objective: str = "sft"
    seq_len_tokens: int
    """Tokens per sequence; 0 for a metric not taken at one length (max_len)."""
    batch_size: int = 1
    partition_size: int | None = None
    """Tokens per decoder-layer chunk (streambp, mst); empty when the method has none."""
    head_partition_size: int | None = None
    """Tokens per LM-head chunk; empty when the method has none."""
    dtype: str = "bfloat16"
    lora_rank: int | None = None
    """LoRA rank; empty for full-parameter training."""
    optimizer: str = "none"
    """Optimizer whose state is resident ('none': backprop only)."""
    attn: str = "auto"
    """Attention kernel asked for: auto, sdpa or flash (a simulation uses its flash-like fake kernel)."""
    protocol: str = "default"
    """Step protocol: default or paper (`streambp_core.step.run.protocol`)."""
    grads: str = "resident"
    """Gradients allocated before the step (resident) or made by it (fresh)."""
    offload: str = "none"
    """The tiers in host memory (`streambp_core.tiers`): none, or a canonical comma list of checkpoints,
    optimizer, params."""
    offload_checkpoints: int = 0
    """1 when the checkpoints were in host memory (from `offload`; a file without the column reads 0)."""
    offload_optimizer: int = 0
    """1 when the optimizer's states, fp32 masters and step were in host memory (from `offload`)."""
    offload_params: int = 0
    """1 when the weights were in host memory, gathered a layer at a time (from `offload`)."""
    gpus: int = 1
    """Ranks of a data-parallel step; the row's memory is one rank's."""
    sp: int = 1
    """Ranks sharing each sequence (Ulysses sequence parallelism; 1: none, what a file without the column
    reads)."""
    shard: str = "none"
    """How each rank holds the model state: none, zero2, zero3 or deepspeed-zero2 (`SHARD_MODES`)."""
    head_mode: str | None = None
    """streambp's LM head, as resolved (`StepSpec.head_mode`): recompute or fused; empty for the other
    methods, which have no streamed head. Not given (None, an empty cell): the method's default head,
    recompute for streambp (StepSpec's default, and the only head before this column existed)."""
    source: str
    """One of SOURCES: how the numbers were obtained."""
    status: str = "ok"
    metric: str
    """What `value` is: one of METRICS (others are allowed)."""
    value: float | None = None
    """The metric's value (GiB, ms, tokens, ratio); empty on oom/error."""
    peak_allocated_gib: float | None = None
    peak_reserved_gib: float | None = None
    step_time_ms: float | None = None
    """Median step time; measured runs only."""
    step_time_p20_ms: float | None = None
    """20th percentile of the timed repeats; measured runs only."""
    step_time_p80_ms: float | None = None
    """80th percentile of the timed repeats; measured runs only."""
    alloc_retries: int | None = None
    """The CUDA caching allocator's `num_alloc_retries` over the measured region; empty off CUDA."""
    num_ooms: int | None = None
    """The CUDA caching allocator's `num_ooms` over the measured region; empty off CUDA."""
    weights_gib: float | None = None
    grads_gib: float | None = None
    optimizer_gib: float | None = None
    checkpoints_gib: float | None = None
    kv_gib: float | None = None
    logits_gib: float | None = None
    temporaries_gib: float | None = None
    kernel_workspace_gib: float | None = None
    """Buffers the attention kernels allocate inside themselves at the peak (simulated rows, from the
    kernels' source: `streambp_core.engine.attention.workspace`); empty on measured rows and older files."""
    budget_gib: float | None = None
    """Device memory the point was judged against."""
    host_peak_gib: float | None = None
    """Most host memory the step held at once (offloaded checkpoints; not part of the device peak); 0
    without offload; empty where not taken."""
    to_host_gib: float | None = None
    """GiB copied device -> host over the step (offloaded checkpoints)."""
    to_device_gib: float | None = None
    """GiB copied host -> device over the step (offloaded checkpoints brought back for backward)."""
    host_budget_gib: float | None = None
    """max_len rows: the host memory per rank the answer was bounded by (--host-budget-gib); empty: host
    unbounded (the answer's host_peak_gib is what it needs, whatever the machine has)."""
    confirmed_layers: int | None = None
    """max_len rows: decoder layers of the step that confirmed the answer (the model's full depth)."""
    error: str = ""
    device_name: str
    torch_version: str = "unknown"
    transformers_version: str = "unknown"
    package_version: str = "unknown"
    git_sha: str = "unknown"
    timestamp: str = ""

    def __post_init__(self) -> None:
        for field in fields(self):
            object.__setattr__(self, field.name, _coerce(field.name, getattr(self, field.name)))
        for name, allowed in _CHOICES.items():
            require_one_of(name, getattr(self, name), allowed)
        object.__setattr__(self, "head_mode", _head_mode_cell(self.method, self.head_mode))
        tiers = Tiers.of(self.offload)  # the cell's text, a canonical tier set (checked above)
        for tier in OFFLOAD_TIERS:  # one column per tier, read from the tier set
            object.__setattr__(self, f"offload_{tier}", int(getattr(tiers, tier)))
        for name in ("method", "model", "metric", "device_name"):
            if not getattr(self, name):
                raise ValueError(f"{name} must not be empty")
        for name in _NON_NEGATIVE:
            if (value := getattr(self, name)) is not None and value < 0:
                raise ValueError(f"{name} must be >= 0, got {value}")
        if self.step_time_ms is not None and self.source == "simulated":
            raise ValueError("step_time_ms is for measured runs only; a simulated row leaves it empty")

    def key(self) -> tuple[str, ...]:
        """The point's identity: its KEY_COLUMNS as CSV text (rows with equal keys replace each other)."""
        return tuple(_format(getattr(self, name)) for name in KEY_COLUMNS)

    @classmethod
    def key_of(cls, **key_fields: object) -> tuple[str, ...]:
        """The key a row with these KEY_COLUMNS values would have (the dataclass defaults fill the rest; a
        streambp point without head_mode is recompute, as its row would be)."""
        values = {**_KEY_DEFAULTS, **key_fields}
        if sorted(values) != sorted(KEY_COLUMNS):
            wrong = sorted(set(values) ^ set(KEY_COLUMNS))
            raise TypeError(f"key_of() takes the KEY_COLUMNS; missing or unknown: {', '.join(wrong)}")
        values["head_mode"] = _head_mode_cell(str(values["method"]), values["head_mode"])
        return tuple(_format(_coerce(name, values[name])) for name in KEY_COLUMNS)

    def to_record(self) -> dict[str, str]:
        """The row as CSV text, column -> cell."""
        return {name: _format(value) for name, value in asdict(self).items()}

    @classmethod
    def from_record(cls, record: dict[str, str]) -> ResultRow:
        """Parse one CSV record (column -> cell text); empty optional cells become None."""
        return cls(**{name: _parse(name, text or "") for name, text in record.items()})


COLUMNS: tuple[str, ...] = tuple(field.name for field in fields(ResultRow))
"""The CSV header, in order."""
KEY_COLUMNS: tuple[str, ...] = (
    "method", "model", "objective", "seq_len_tokens", "batch_size", "partition_size",
    "head_partition_size", "dtype", "lora_rank", "optimizer", "attn", "protocol", "grads", "offload",
    "gpus", "sp", "shard", "head_mode", "source", "metric", "device_name",
)  # fmt: skip
_CHOICES = {
    "source": SOURCES, "status": STATUSES, "attn": ATTN_BACKENDS, "protocol": PROTOCOLS, "grads": GRADS_MODES,
    "offload": OFFLOAD_MODES, "shard": SHARD_MODES,
}  # fmt: skip
_HINTS = typing.get_type_hints(ResultRow)
_OPTIONAL = {name for name, hint in _HINTS.items() if type(None) in typing.get_args(hint)}
_TYPES = {name: next((a for a in typing.get_args(h) if a is not type(None)), h) for name, h in _HINTS.items()}
_NON_NEGATIVE = [name for name, kind in _TYPES.items() if kind in (int, float) and name != "value"]
_KEY_DEFAULTS = {
    f.name: f.default for f in fields(ResultRow) if f.default is not MISSING and f.name in KEY_COLUMNS
}


def require_one_of(name: str, value: str, allowed: tuple[str, ...]) -> None:
    """ValueError naming column `name` unless `value` is one of `allowed`."""
    if value not in allowed:
        raise ValueError(f"{name} must be one of {', '.join(allowed)}, got {value!r}")


def _head_mode_cell(method: str, head_mode: str | None) -> str:
    """A row's head_mode: a streambp row's head (recompute when not given), checked; empty for any other
    method (ValueError when one is given)."""
    if method == "streambp":
        head_mode = head_mode or "recompute"
        require_one_of("head_mode", head_mode, RESOLVED_HEAD_MODES)
        return head_mode
    if head_mode:
        raise ValueError(f"head_mode is streambp's LM head: a {method} row leaves it empty, "
                         f"got {head_mode!r}")
    return ""


def _coerce(name: str, value: object) -> object:
    """`value` as the plain Python type of column `name` (numpy scalars become int/float; NaN -> None)."""
    kind = _TYPES[name]
    if value is None and name not in _OPTIONAL:
        raise ValueError(f"{name} must not be empty")
    if value is None:
        return None
    if kind is int:
        return int(value) if isinstance(value, float) and value.is_integer() else operator.index(value)
    if kind is float:
        number = float(value)
        return None if math.isnan(number) and name in _OPTIONAL else number
    return str(value)


def _format(value: object) -> str:
    if value is None:
        return ""
    return repr(value) if isinstance(value, float) else str(value)


def _parse(name: str, text: str) -> object:
    if name not in _TYPES:
        raise SchemaError(f"unknown column {name!r}")
    if text == "" and name in _OPTIONAL:
        return None
    kind = _TYPES[name]
    if kind is int:
        return int(text) if text.lstrip("-").isdigit() else float(text)  # "500.0" -> 500 in _coerce
    return float(text) if kind is float else text


def spec_fields(spec: StepSpec, seq_len_tokens: int | None = None) -> dict[str, object]:
    """The KEY_COLUMNS of a row about step `spec` but source, metric and device_name (partition cells
    empty for methods without partitions, LoRA rank empty for full parameters, head mode empty but for
    streambp); `seq_len_tokens` overrides the spec's (0 for a max_len row)."""
    return {
        "method": spec.method, "model": spec.model, "objective": spec.objective,
        "seq_len_tokens": spec.seq_len_tokens if seq_len_tokens is None else seq_len_tokens,
        "batch_size": spec.batch_size,
        "partition_size": spec.stream.partition_size if spec.partitioned else None,
        "head_partition_size": spec.stream.head_partition_size if spec.partitioned else None,
        "dtype": spec.dtype, "lora_rank": spec.lora_rank or None, "optimizer": spec.optimizer,
        "attn": spec.stream.attn, "protocol": spec.protocol, "grads": spec.grads,
        "offload": str(spec.stream.offload),
        "gpus": spec.gpus, "sp": spec.sp, "shard": spec.shard, "head_mode": row_head_mode(spec),
    }  # fmt: skip


def row_head_mode(spec: StepSpec) -> str:
    """The head_mode cell of a row about step `spec`: its resolved head for streambp, else empty."""
    return spec.stream.head_mode if spec.method == "streambp" else ""


def memory_columns(peak_bytes: int | None, breakdown_bytes: dict[str, int]) -> dict[str, float | None]:
    """peak_allocated_gib and one `<category>_gib` column per category of a peak."""
    by_category = {f"{name}_gib": value / 2**30 for name, value in breakdown_bytes.items()}
    return {"peak_allocated_gib": None if peak_bytes is None else peak_bytes / 2**30, **by_category}


def host_columns(measured: object) -> dict[str, float | None]:
    """The host pool's columns of a step (a ProbeResult or SimResult: anything with `host_peak_bytes`,
    `to_host_bytes`, `to_device_bytes`, None where not taken), in GiB."""
    names = {"host_peak_gib": "host_peak_bytes", "to_host_gib": "to_host_bytes",
             "to_device_gib": "to_device_bytes"}
    values = {column: getattr(measured, attribute, None) for column, attribute in names.items()}
    return {column: None if value is None else value / 2**30 for column, value in values.items()}


def allocator_columns(measured: object) -> dict[str, float | int | None]:
    """The CUDA allocator's columns of a measurement (a ProbeResult or MeasuredStep: anything with
    `peak_reserved_bytes`, `alloc_retries`, `num_ooms`): reserved peak (GiB), retries, OOMs; None off CUDA."""
    reserved = measured.peak_reserved_bytes
    return {
        "peak_reserved_gib": None if reserved is None else reserved / 2**30,
        "alloc_retries": measured.alloc_retries,
        "num_ooms": measured.num_ooms,
    }


def rows_to_frame(rows: Iterable[ResultRow]) -> pd.DataFrame:
    """Rows as a DataFrame with one column per field, in schema order, int columns as nullable Int64."""
    import pandas as pd

    frame = pd.DataFrame([asdict(row) for row in rows], columns=list(COLUMNS))
    dtypes = {name: {int: "Int64", float: "float64"}.get(_TYPES[name], "str") for name in COLUMNS}
    return frame.astype(dtypes)
