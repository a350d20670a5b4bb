"""The summary tables `streambp-bench selfcheck` prints from its results CSV (numbers are computed by
`selfcheck.check`; this module only lays them out)."""

from __future__ import annotations

import pandas as pd
from rich.console import Console
from rich.table import Table


def print_summary(console: Console, frame: pd.DataFrame | None, where: str) -> bool:
    """Summary tables of the self-check's rows (None: no file yet); True when a bf16 verification or an
    attention path failed."""
    if frame is None or frame.empty:
        return False
    failed = False
    grads = frame[frame.metric == "grad_rel_err"]
    if not grads.empty:
        dtype = grads.dtype.iloc[0]
        reference = "fp32 plain (2x plain-bf16 rule)" if dtype == "bfloat16" else "plain"
        title = f"{dtype} gradients vs {reference}"
        table = Table(title=f"{title}, {_sources(grads)} ({where})", title_justify="left")
        for column in ("model", "objective", "attn", "method", "max rel err", "status"):
            table.add_column(column)
        for row in grads.itertuples():
            table.add_row(row.model, row.objective, row.attn, row.method, f"{row.value:.3e}", row.status)
        failed = bool((grads.status != "ok").any())
        console.print(table)
    kernels = frame[frame.metric == "grad_err_ratio"]
    if not kernels.empty:
        failed = failed or bool((kernels.status != "ok").any())
        console.print(_kernel_table(kernels, where))
    tables = (_memory_table(frame, where), _owed_table(frame, where), _max_len_table(frame, where),
              _time_table(frame, where), _profile_table(frame, where), _workspace_table(frame, where))
    for table in tables:
        if table.row_count:  # a skipped step (--skip-*) has no rows: no empty table
            console.print(table)
    return failed


def _kernel_table(kernels: pd.DataFrame, where: str) -> Table:
    """Each attention path's bf16 gradient error over the written-out bf16 attention's (ok at most 2)."""
    title = f"bf16 attention paths: error / written-out bf16 error, {_sources(kernels)} ({where})"
    table = Table(title=title, title_justify="left")
    for column in ("path", "queries", "keys", "ratio", "status"):
        table.add_column(column, justify="left" if column in ("path", "status") else "right")
    for row in kernels.itertuples():
        table.add_row(row.model.removeprefix("attention "), str(row.partition_size), str(row.seq_len_tokens),
                      f"{row.value:.2f}", row.status)
    return table


def _memory_table(frame: pd.DataFrame, where: str) -> Table:
    """Measured vs simulated peak per method and length; with the CUDA allocator's reserved peak, alloc
    retries and OOMs when the measured rows have them (a CUDA run)."""
    table = Table(title=f"peak GiB: simulated vs measured ({where})", title_justify="left")
    memory = frame[(frame.metric == "peak_memory") & ~_owed(frame)]
    measured = memory[memory.source != "simulated"].set_index(["method", "seq_len_tokens"])
    simulated = memory[memory.source == "simulated"].set_index(["method", "seq_len_tokens"])
    allocator = bool(measured.alloc_retries.notna().any())
    extra = ("reserved", "alloc retries", "OOMs") if allocator else ()
    for column in ("method", "tokens", "measured", "simulated", "sim/measured", *extra):
        table.add_column(column, justify="right")
    for key, row in measured.iterrows():
        sim = simulated.loc[key, "value"] if key in simulated.index else None
        ratio = f"{sim / row.value:.3f}" if sim is not None and row.value else "-"
        counts = (_gib(row.peak_reserved_gib), _count(row.alloc_retries), _count(row.num_ooms))
        table.add_row(key[0], str(key[1]), _gib(row.value), _gib(sim), ratio, *counts[: len(extra)])
    return table


def _owed(frame: pd.DataFrame) -> pd.Series:
    """The peak rows of the items beyond the memory step: offloaded, sharded or with an optimizer, or
    with the 1024-token head those items run (the memory step's head partition is the plan's, 100)."""
    wide_head = frame.head_partition_size.eq(1024).fillna(False).astype(bool)  # empty for plain, checkpoint
    return (frame.offload != "none") | (frame.shard != "none") | (frame.optimizer != "none") | wide_head


OWED_KEY = ["model", "method", "seq_len_tokens", "offload", "shard", "optimizer"]


def _owed_table(frame: pd.DataFrame, where: str) -> Table:
    """The owed peak rows (offload, FSDP2, host tiers): measured and simulated device peak, pinned host
    peak and the simulated host pool, the step time and, offloaded, its ratio to the resident step."""
    rows = frame[(frame.metric == "peak_memory") & _owed(frame)]
    table = Table(title=f"offload, FSDP2 and host tiers: device and host GiB ({where})", title_justify="left")
    for column in ("model", "method", "tokens", "offload", "shard", "measured", "simulated", "sim/measured",
                   "pinned host", "sim host pool", "step ms", "vs resident", "status"):
        table.add_column(column, justify="left" if column in ("model", "method", "offload", "shard",
                                                             "status") else "right")
    simulated = rows[rows.source == "simulated"].set_index(OWED_KEY)
    measured = rows[rows.source != "simulated"]
    resident = measured[measured.offload == "none"].set_index([k for k in OWED_KEY if k != "offload"])
    for _, row in measured.iterrows():
        key = tuple(row[OWED_KEY])
        sim = simulated.loc[key] if key in simulated.index else None
        base = tuple(row[[k for k in OWED_KEY if k != "offload"]])
        slower = (f"{row.step_time_ms / resident.loc[base, 'step_time_ms']:.3f}"
                  if row.offload != "none" and base in resident.index and row.step_time_ms else "-")
        value = None if sim is None else sim.value
        table.add_row(row.model, row.method, str(row.seq_len_tokens), row.offload, row.shard, _gib(row.value),
                      _gib(value), f"{value / row.value:.3f}" if value and row.value else "-",
                      _gib(row.host_peak_gib), _gib(None if sim is None else sim.host_peak_gib),
                      _ms(row.step_time_ms), slower, row.status)
    return table


def _max_len_table(frame: pd.DataFrame, where: str) -> Table:
    """max-len's answers: the measured search and the simulated one, per model, method and budget."""
    rows = frame[frame.metric == "max_len"]
    table = Table(title=f"max length, tokens ({where})", title_justify="left")
    for column in ("model", "method", "budget GiB", "source", "max length", "status"):
        table.add_column(column)
    for _, row in rows.iterrows():
        tokens = "-" if pd.isna(row.value) else f"{int(row.value):,}"
        table.add_row(row.model, row.method, f"{row.budget_gib:g}", row.source, tokens,
                      row.status if row.status == "ok" else f"{row.status}: {row.error}")
    return table


WORKSPACE_METRICS = {"peak_memory_unblocked": "unblocked", "peak_memory_blocked": "blocked"}
"""The kernel-workspace rows' metrics and how the table names their attention backward."""


def _workspace_table(frame: pd.DataFrame, where: str) -> Table:
    """streambp's peak per attention kernel, backward (unblocked, blocked) and length: measured, simulated,
    their ratio, and the kernel workspace the simulation counted at its peak."""
    rows = frame[frame.metric.isin(list(WORKSPACE_METRICS))]
    table = Table(title=f"kernel workspace: streambp peak GiB, attention backward unblocked vs blocked "
                        f"({where})", title_justify="left")
    for column in ("attn", "backward", "tokens", "measured", "simulated", "sim/measured", "kernel workspace",
                   "status"):
        table.add_column(column, justify="left" if column in ("attn", "backward", "status") else "right")
    key = ["attn", "metric", "seq_len_tokens"]
    simulated = rows[rows.source == "simulated"].set_index(key)
    for _, row in rows[rows.source != "simulated"].iterrows():
        sim = simulated.loc[tuple(row[key])] if tuple(row[key]) in simulated.index else None
        value = None if sim is None else sim.value
        ratio = f"{value / row.value:.3f}" if value is not None and row.value else "-"
        table.add_row(row.attn, WORKSPACE_METRICS[row.metric], str(row.seq_len_tokens), _gib(row.value),
                      _gib(value), ratio, _gib(None if sim is None else sim.kernel_workspace_gib),
                      row.status if sim is None else sim.status)
    return table


def _variant(method: str, head_partition, partition, tokens) -> str:
    """'checkpoint', 'streambp head <n>' (layer partition T/3), or 'streambp auto' (partitions chosen)."""
    if method == "checkpoint":
        return method
    return f"{method} head {head_partition}" if partition == -(-tokens // 3) else f"{method} auto"


def _variants(rows: pd.DataFrame) -> list[str]:
    return [_variant(*row) for row in zip(rows.method, rows.head_partition_size, rows.partition_size,
                                          rows.seq_len_tokens, strict=True)]


def _time_table(frame: pd.DataFrame, where: str) -> Table:
    """Median step time per length: checkpoint, then streambp per LM-head partition and its ratio."""
    times = frame[frame.metric == "step_time"]
    table = Table(title=f"step time ms, median, {_sources(times)} ({where})", title_justify="left")
    times = times.assign(variant=_variants(times))
    grid = times.pivot_table(index="seq_len_tokens", columns="variant", values="value")
    variants = [v for v in grid.columns if v != "checkpoint"]
    table.add_column("tokens", justify="right")
    table.add_column("checkpoint", justify="right")
    for variant in variants:
        table.add_column(variant, justify="right")
        table.add_column("/checkpoint", justify="right")
    for tokens, row in grid.iterrows():
        ckpt = row.get("checkpoint")
        cells = []
        for variant in variants:
            ms = row.get(variant)
            cells += [_ms(ms), f"{ms / ckpt:.3f}" if ckpt and ms and not pd.isna(ms) else "-"]
        table.add_row(str(tokens), _ms(ckpt), *cells)
    return table


def _profile_table(frame: pd.DataFrame, where: str) -> Table:
    """Kernel time by class (rows) per profiled variant (columns), ms of one step."""
    profiled = frame[frame.metric.str.startswith("kernel_ms_")]
    tokens = ", ".join(str(t) for t in sorted(set(profiled.seq_len_tokens)))
    table = Table(title=f"kernel time ms of one step by class, {tokens or '-'} tokens, {_sources(profiled)} "
                        f"({where})", title_justify="left")
    profiled = profiled.assign(
        variant=_variants(profiled),
        kernel_class=profiled.metric.str.removeprefix("kernel_ms_"),
    )
    grid = profiled.pivot_table(index="kernel_class", columns="variant", values="value", sort=False)
    table.add_column("class")
    for variant in grid.columns:
        table.add_column(variant, justify="right")
    for kernel_class, row in grid.iterrows():
        table.add_row(kernel_class, *(_ms(row.get(v)) for v in grid.columns))
    if not grid.empty:
        table.add_row("total", *(_ms(grid[v].sum()) for v in grid.columns))
    return table


def _sources(rows: pd.DataFrame) -> str:
    """How the rows' numbers were obtained (measured-cuda, measured-cpu, simulated), comma-separated."""
    return ", ".join(sorted(set(rows.source))) or "no rows"


def _ms(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.1f}"


def _gib(value) -> str:
    return "-" if value is None or pd.isna(value) else f"{value:.4g}"


def _count(value) -> str:
    return "-" if value is None or pd.isna(value) else str(int(value))


def plan_table(listed: list[dict], total_minutes: float, budget_minutes: float) -> Table:
    """The plan's items (name, estimated minutes on an H200, what), then the total against the budget."""
    table = Table(title="selfcheck plan: estimated minutes on an H200", title_justify="left")
    for column in ("item", "minutes", "what"):
        table.add_column(column, justify="right" if column == "minutes" else "left")
    for entry in listed:
        table.add_row(entry["item"], f"{entry['estimated_minutes']:.2f}", entry["what"])
    table.add_row("total", f"{total_minutes:.2f}", f"budget {budget_minutes:g} min: "
                  f"{'within' if total_minutes <= budget_minutes else 'OVER'}")
    return table


def print_items(console: Console, outcomes, where: str) -> None:
    """One line per item run: its rows, its minutes (measured, wall clock) next to its H200 estimate, and
    its status with the reason it failed."""
    if not outcomes:
        return
    table = Table(title=f"items: wall-clock minutes, measured ({where}), vs estimated on an H200",
                  title_justify="left")
    for column in ("item", "rows", "minutes", "estimated", "status"):
        table.add_column(column, justify="left" if column in ("item", "status") else "right")
    for outcome in outcomes:
        status = f"failed: {outcome.error}" if outcome.error else "ok"
        table.add_row(outcome.name, str(outcome.rows), f"{outcome.seconds / 60:.2f}",
                      f"{outcome.estimated_s / 60:.2f}", status)
    console.print(table)
