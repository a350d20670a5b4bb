"""`streambp-bench verify fsdp --nproc N`: the sharded check across N ranks, printed as a table.

The work is `streambp_core.verify.sharded.verify_sharded`; this module checks the ranks and the backend
before any process starts, shows progress while the ranks run, and prints the gradients' errors and each
step's collectives (calls and bytes, per step and per FSDP unit).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

import typer
from rich.table import Table

from streambp_bench.errors import print_error
from streambp_bench.output import emit, stderr_console
from streambp_core.measure.units import format_size
from streambp_core.parallel.launch import RankError, backend_for, check_nproc
from streambp_core.verify.methods import VerifySpec
from streambp_core.verify.sharded import ShardedReport, verify_sharded

T = TypeVar("T")


def run_sharded(spec: VerifySpec, nproc: int, stages: tuple[str, ...], *, as_json: bool) -> bool:
    """Verify `spec` across `nproc` ranks for every stage in `stages`; print; whether every method passed.
    Bad input (ranks above the cores or GPUs, a missing backend, LoRA, a dtype without an exact bound)
    raises ConfigError before any rank starts."""
    backend = backend_for(spec.device)
    check_nproc(nproc, spec.device)
    report = on_ranks(f"verifying on {nproc} ranks ({backend}): {', '.join(stages)} ...",
                      lambda: verify_sharded((spec,), nproc=nproc, shards=stages))
    emit(report.to_dict(), as_json, lambda console: _print(console, report, spec, backend))
    return report.ok


def on_ranks(status: str, run: Callable[[], T]) -> T:
    """`run()` (a multi-rank check) under a progress line `status`; a rank that fails or dies is one
    line naming it and exit code 1 (a failure, not bad input)."""
    try:
        with stderr_console().status(status):
            return run()
    except RankError as error:
        print_error(error)
        raise typer.Exit(code=1) from None


def render_table(report: ShardedReport) -> Table:
    """One row per (shard stage, method): the error against plain and the step's collectives."""
    table = Table(title=f"all-gathered gradients vs single-process plain, {report.nproc} ranks",
                  title_justify="left")
    for column in ("shard", "method", "max rel err", "tolerance", "all-gathers", "reduce-scatters",
                   "per unit", "ok"):
        table.add_column(column, justify="left" if column in ("shard", "method", "ok") else "right")
    for r in report.results:
        per_unit = f"{r.all_gathers / r.units:g} AG + {r.reduce_scatters / r.units:g} RS"
        table.add_row(
            r.shard, r.method, f"{r.max_rel_err:.2e}", f"{r.tolerance:.0e}",
            f"{r.all_gathers} ({format_size(r.all_gather_bytes)})",
            f"{r.reduce_scatters} ({format_size(r.reduce_scatter_bytes)})", per_unit,
            "[green]pass[/]" if r.ok else "[bold red]FAIL[/]",
        )
    return table


def _print(console, report: ShardedReport, spec: VerifySpec, backend: str) -> None:
    console.print(render_table(report))
    units = report.results[0].units if report.results else 0
    step = spec.step
    console.print(
        f"{report.source}: {step.model}, {step.dtype}, {report.nproc} ranks ({backend}), seq_len "
        f"{step.seq_len_tokens} and batch {step.batch_size} per rank, ps {step.stream.partition_size}, "
        f"ps-head {step.stream.head_partition_size}, objective {step.objective}, seed {step.seed}; "
        f"{units} FSDP units (the decoder layers and the root); collectives of one step on one rank, bytes "
        "of the full tensors",
        soft_wrap=True)
    console.print("[green]all methods match plain[/]" if report.ok
                  else "[bold red]some methods do not match plain[/]")
