"""Results CSVs written by an earlier schema: the headers still read, and how their rows are completed.

Schema 1 (up to the `attn`, `protocol` and `grads` key columns and the CUDA allocator counters) lacks
five columns. A schema-1 row is read as what its producers ran:
- attn "auto" and protocol "default" (a schema-1 `max-len --protocol paper` row cannot be told apart
  from a default one: it reads as default);
- grads "fresh" when the row has an optimizer (a training step with an optimizer sets the gradients to
  None after each step), else "resident";
- alloc_retries and num_ooms empty.
Rewriting such a file (any upsert) writes the current header.

Schema 2 (the header before `ADDED_COLUMNS`) reads each missing added column as the cell
`ADDED_COLUMNS` gives it: empty for an optional column, and for a key column the value every older row
stood for (offload "none": nothing was offloaded before the column existed; gpus 1 and shard "none":
one unsharded GPU; sp 1: no sequence parallelism). head_mode reads empty, which a row takes as its
method's default head (`ResultRow.head_mode`): recompute on a streambp row, the only head streambp ran
before the column existed, and empty on any other method's, as new rows have it, so a re-run upserts
onto the old row.
The per-tier columns (offload_checkpoints, offload_optimizer, offload_params) read 0 and are then set
from the row's `offload` (a file with offload "checkpoints" and no tier columns reads
offload_checkpoints 1).
"""

from __future__ import annotations

from collections.abc import Sequence

SCHEMA_1_COLUMNS: tuple[str, ...] = (
    "method", "model", "objective", "seq_len_tokens", "batch_size", "partition_size",
    "head_partition_size", "dtype", "lora_rank", "optimizer", "source", "status", "metric", "value",
    "peak_allocated_gib", "peak_reserved_gib", "step_time_ms", "weights_gib", "grads_gib", "optimizer_gib",
    "checkpoints_gib", "kv_gib", "logits_gib", "temporaries_gib", "budget_gib", "error", "device_name",
    "torch_version", "transformers_version", "package_version", "git_sha", "timestamp",
)  # fmt: skip
"""The header of schema 1, exactly (committed results/*.csv carry it)."""


ADDED_COLUMNS: dict[str, str] = {
    "step_time_p20_ms": "", "step_time_p80_ms": "", "confirmed_layers": "",
    "offload": "none", "host_peak_gib": "", "to_host_gib": "", "to_device_gib": "",
    "gpus": "1", "shard": "none", "head_mode": "", "kernel_workspace_gib": "",
    "offload_checkpoints": "0", "offload_optimizer": "0", "offload_params": "0", "sp": "1",
    "host_budget_gib": "",
}  # fmt: skip
"""Columns added since schema 2 -> the cell a file without the column reads (module docstring)."""


def is_schema_1(header: Sequence[str] | None) -> bool:
    """Whether `header` is schema 1's: the same columns, each once (in any order)."""
    return header is not None and sorted(header) == sorted(SCHEMA_1_COLUMNS)


def complete_schema_1(record: dict[str, str]) -> dict[str, str]:
    """A schema-1 record (column -> cell text) with the later columns filled (module docstring)."""
    optimizer = record.get("optimizer") or "none"
    return {
        **ADDED_COLUMNS,
        **record,
        "attn": "auto",
        "protocol": "default",
        "grads": "resident" if optimizer == "none" else "fresh",
        "alloc_retries": "",
        "num_ooms": "",
    }
