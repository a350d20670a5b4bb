"""`streambp-bench sweep`: peak memory (and measured step time) over a grid, one CSV row per point."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from streambp_bench import options as opt
from streambp_bench.errors import USER_ERROR_EXIT_CODE, print_error, user_errors

if TYPE_CHECKING:
    from streambp_bench import experiments as exp
    from streambp_bench.results import ResultRow, ResultsFile

HELP = (
    "Run a grid of training steps and write one results row per point: the peak memory and the memory "
    "by category (weights, grads, optimizer, checkpoints, K/V, logits, temporaries); on cpu/cuda also the "
    "step time (median of 5 timed steps after 1 warm-up, wall clock) as a second row (metric step_time).\n\n"
    "[bold]--device sim[/] (the default without a GPU) simulates each step on meta tensors; a simulated "
    "peak above --budget-gib is written with status oom. [bold]cpu[/] / [bold]cuda[/] run real steps.\n\n"
    "Each point is written as soon as it finishes (atomic rewrite of the CSV), so Ctrl-C or a kill loses "
    "no finished point; running the same sweep again skips the points already in the file (resume) and "
    "runs the rest. --force re-runs every point and replaces its rows. Lengths take a k suffix (1k = 1024 "
    "tokens) and ranges START:STOP:STEP (inclusive).\n\n"
    "Each row records the attention kernel (--attn), the step protocol and whether gradients existed "
    "before the step, so a sweep with another --attn is other points: it runs them, it does not skip them."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench sweep --seq-len 4k:64k:4k --method checkpoint,streambp[/]    (Qwen/Qwen3-8B, simulated)

[cyan]streambp-bench sweep -m Qwen/Qwen3-8B --method streambp --ps 500,1k,2k,5k --seq-len 8k,32k,64k[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-4B --objective grpo -b 8 --lora-rank 32 --optimizer adamw[/]

[cyan]streambp-bench sweep -m tiny/llama --device cpu --dtype float32 --seq-len 256,512 --ps 64 --out r.csv[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-4B --device cuda --attn sdpa --seq-len 8k,16k --out sdpa.csv[/]
"""


def _progress() -> Progress:
    columns = (
        BarColumn(bar_width=24),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        TextColumn("ETA"),
        TimeRemainingColumn(),
        TextColumn("{task.description}"),
    )
    return Progress(*columns, console=Console(stderr=True), transient=False)


def _describe(point: exp.Point, rows: list[ResultRow] | None) -> str:
    where = f"{point.method} {point.model} T={point.seq_len_tokens:,}"
    if point.partition_size:
        where += f" ps={point.partition_size}"
    if rows is None:
        return f"{where}: already done"
    row = rows[0]
    if row.status == "error":
        return f"{where}: error"
    return f"{where}: {row.peak_allocated_gib or 0:.2f} GiB ({row.status})"


def open_results(out: Path) -> ResultsFile:
    """The results file at `out`, its existing rows checked (SchemaError for another schema)."""
    from streambp_bench.results import ResultsFile

    results = ResultsFile(out)
    results.rows()
    return results


@user_errors
def sweep(
    seq_len: Annotated[
        str, typer.Option("--seq-len", "-T", help="Comma list and/or START:STOP:STEP ranges; k = 1024.")
    ] = "4k:32k:4k",
    ps: Annotated[
        str, typer.Option("--ps", help="Comma list of layer partition sizes (streambp, mst).")
    ] = "500",
    ps_head: opt.HeadPartitionSize = 100,
    method: opt.Methods = "checkpoint,streambp",
    model: Annotated[
        str, typer.Option("--model", "-m", help="Comma list of presets or local directories.")
    ] = "Qwen/Qwen3-8B",
    objective: opt.ObjectiveOption = opt.Objective.sft,
    lora_rank: opt.LoraRank = 0,
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="none (backprop only, grads resident) or adamw.")
    ] = "none",
    batch_size: Annotated[
        int, typer.Option("--batch-size", "-b", help="Sequences (sft), group size (grpo) or pairs (dpo).")
    ] = 1,
    dtype: opt.DtypeOption = opt.Dtype.bfloat16,
    attn: Annotated[
        opt.Attn,
        typer.Option(
            "--attn",
            help="Attention kernel of a CUDA step: flash (flash-attn), sdpa, or auto; recorded in each row. "
            "A simulated point uses the simulator's flash-like fake kernel whatever this is (a cpu point, "
            "the exact CPU kernel).",
        ),
    ] = opt.Attn.auto,
    device: Annotated[
        str, typer.Option("--device", help="auto (cuda if present, else sim), cuda, cpu or sim.")
    ] = "auto",
    budget_gib: Annotated[
        float | None, typer.Option("--budget-gib", help="Budget of a point (default: GPU memory, else 80).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results CSV to upsert into.")] = Path(
        "results/sweep.csv"
    ),
    force: Annotated[bool, typer.Option("--force", help="Re-run points already in --out.")] = False,
) -> None:
    """Run the grid and upsert its rows into --out (help text: `HELP`)."""
    from streambp_bench import experiments as exp
    from streambp_bench.results import SchemaError

    where = exp.resolve_where(device, budget_gib)
    points = exp.expand_grid(
        methods=opt.split_list(method) or ("",),
        models=opt.split_list(model) or ("",),
        seq_lens=exp.parse_token_list(seq_len),
        partition_sizes=exp.parse_token_list(ps, "partition size"),
        head_partition_size=ps_head,
        objective=objective.value,
        batch_size=batch_size,
        dtype=dtype.value,
        lora_rank=lora_rank,
        optimizer=optimizer,
        attn=attn.value,
    )
    try:
        results = open_results(out)
    except (SchemaError, OSError) as error:
        print_error(error)
        raise typer.Exit(code=USER_ERROR_EXIT_CODE) from None
    console = Console(stderr=True, highlight=False)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    with _progress() as progress:
        task = progress.add_task(f"sweep ({where.source})", total=len(points))

        def advance(point: exp.Point, rows: list[ResultRow] | None) -> None:
            counts["skipped" if rows is None else "ran"] += 1
            counts["failed"] += int(bool(rows) and rows[0].status == "error")
            progress.update(task, advance=1, description=escape(_describe(point, rows)))

        try:
            exp.run_points(points, where, results, force=force, on_point=advance)
        except KeyboardInterrupt:
            progress.stop()
            console.print(
                f"interrupted: {counts['ran']} points written to {escape(str(out))}; run the same command "
                "again to resume"
            )
            raise typer.Exit(code=130) from None
    console.print(
        f"{counts['ran']} points run, {counts['skipped']} already done, {counts['failed']} failed; "
        f"rows in {escape(str(out))}",
        soft_wrap=True,
    )
