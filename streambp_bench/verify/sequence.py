"""`streambp-bench verify sp --nproc N --sp S`: sequence parallelism (Ulysses) across N ranks, as a table.

The work is `streambp_core.verify.sequence.verify_sequence`; this module refuses bad input
before any rank starts (S not dividing N, more ranks than the cores or GPUs, heads that cannot split over
S ranks) and prints each method's error against single-process plain over the whole sequence
and the all-to-alls of its step.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from streambp_bench.output import emit
from streambp_bench.verify.sharded import on_ranks
from streambp_core.config import ConfigError, sequence_group_problem
from streambp_core.measure.units import format_size

if TYPE_CHECKING:
    from streambp_core.verify.methods import VerifySpec


def check_sequence_options(sp: int, nproc: int) -> None:
    """ConfigError for an --sp that cannot group the --nproc ranks (before torch is needed)."""
    if sp < 1:
        raise ConfigError(f"--sp must be at least 1, got {sp}")
    if (problem := sequence_group_problem(sp, nproc, "--nproc")) is not None:
        raise ConfigError(problem)


def run_sequence(spec: VerifySpec, nproc: int, sp: int, shard: str | None, *, as_json: bool) -> bool:
    """Verify `spec` with `sp` ranks per sequence across `nproc` ranks (weights sharded with FSDP2 stage
    `shard` over every rank when given); print; whether every method passed."""
    from streambp_core.parallel.launch import backend_for
    from streambp_core.verify.sequence import check_sequence_spec, verify_sequence

    backend = backend_for(spec.device)
    check_sequence_spec(spec, nproc, sp, shard)
    report = on_ranks(f"verifying sequence parallelism on {nproc} ranks ({backend}) ...",
                      lambda: verify_sequence((spec,), nproc=nproc, sp=sp, shard=shard))
    emit(report.to_dict(), as_json, lambda console: _print(console, report, spec, backend))
    return report.ok


def _weights(shard: str) -> str:
    return "whole on each rank" if shard == "none" else f"sharded over every rank (FSDP2 {shard})"


def render_table(report) -> Table:
    """One row per method: the error against plain and the step's collectives on one rank."""
    table = Table(title=f"gradients summed over {report.sp} sequence ranks vs single-process plain, "
                        f"{report.nproc} ranks", title_justify="left")
    for column in ("method", "max rel err", "tolerance", "loss abs err", "all-to-alls", "per layer",
                   "all-reduces", "ok"):
        table.add_column(column, justify="left" if column in ("method", "ok") else "right")
    for r in report.results:
        table.add_row(
            r.method, f"{r.max_rel_err:.2e}", f"{r.tolerance:.0e}", f"{r.loss_abs_err:.2e}",
            f"{r.all_to_alls} ({format_size(r.all_to_all_bytes)})", f"{r.all_to_alls / r.layers:g}",
            str(r.all_reduces), "[green]pass[/]" if r.ok else "[bold red]FAIL[/]",
        )
    return table


def _print(console, report, spec: VerifySpec, backend: str) -> None:
    console.print(render_table(report))
    step = spec.step
    chunks = report.results[0].chunks if report.results else 0
    console.print(
        f"{report.source}: {step.model}, {step.dtype}, {report.nproc} ranks ({backend}) in groups of "
        f"{report.sp} sharing each sequence, weights {_weights(report.shard)}, seq_len "
        f"{step.seq_len_tokens}, batch {step.batch_size}, ps "
        f"{step.stream.partition_size} ({chunks} lockstep chunks per layer), ps-head "
        f"{step.stream.head_partition_size}, padding {spec.padding}, objective {step.objective}, lora rank "
        f"{step.lora_rank}, streambp "
        f"head {step.stream.head_mode}, offload {step.stream.offload}, seed {step.seed}; collectives of "
        "one step on rank 0 (bytes received), gradient sums excluded",
        soft_wrap=True)
    console.print("[green]all methods match plain[/]" if report.ok
                  else "[bold red]some methods do not match plain[/]")
