"""`streambp-bench max-len`: the longest sequence each method can back-propagate within a memory budget."""

from __future__ import annotations

import json
from enum import Enum
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from streambp_bench import options as opt
from streambp_bench.errors import print_error, user_errors

HELP = (
    "Find the longest sequence each method can back-propagate within a memory budget, and show where the "
    "memory goes at that length.\n\n"
    "[bold]--device sim[/] (the default without a GPU) runs the real training step on meta tensors on the "
    "CPU and tracks every allocation: weights are never materialised, so any preset works on a laptop. "
    "The step is simulated with 2 and 3 decoder layers and extrapolated linearly to the model's depth. "
    "[bold]--device cuda[/] measures the allocator's peak, one child process per probe (an OOM is a data "
    "point); [bold]--device cpu[/] measures real CPU tensors with the tracker (small models).\n\n"
    "Search: a secant-guided bracket, then secant/bisection until the bracket (longest length that fits, "
    "shortest that does not) is within max(1%, 128 tokens).\n\n"
    "Protocol: random token ids without padding, weights and gradients in --dtype, gradients already "
    "allocated (--grads resident: a gradient-accumulation micro-step, as in the paper's Fig. 3) or not "
    "(--grads fresh); no optimizer. --protocol paper mimics the paper's script on transformers 4.51 "
    "(output logits held through backward, GQA K/V expanded)."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench max-len[/]    (Qwen/Qwen3-8B, all methods, simulated, 80 GiB)

[cyan]streambp-bench max-len -m Qwen/Qwen3-14B --method checkpoint,streambp --json[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-8B --protocol paper --out results/maxlen.csv[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-4B --device cuda --budget-gib 40[/]

[cyan]streambp-bench max-len -m tiny/qwen3 --device cpu --budget-gib 0.01 --ps 64 --ps-head 32[/]
"""


class Grads(str, Enum):
    """Whether gradients exist before the step."""

    resident = "resident"
    fresh = "fresh"


class Protocol(str, Enum):
    """Which step to size (see `streambp_core.measure.protocol`)."""

    default = "default"
    paper = "paper"


@user_errors
def max_len(
    model: opt.Model = "Qwen/Qwen3-8B",
    method: Annotated[
        str, typer.Option("--method", help="'all', or a comma list of plain, checkpoint, mst, streambp.")
    ] = "all",
    device: Annotated[
        opt.Where, typer.Option("--device", help="auto: cuda if present, else sim.")
    ] = opt.Where.auto,
    budget_gib: Annotated[
        float | None,
        typer.Option(
            "--budget-gib", help="Memory budget in GiB (2^30 B); default: the GPU's total memory, else 80."
        ),
    ] = None,
    ps: opt.PartitionSize = 500,
    ps_head: opt.HeadPartitionSize = 100,
    batch_size: opt.BatchSize = 1,
    dtype: opt.DtypeOption = opt.Dtype.bfloat16,
    grads: Annotated[
        Grads,
        typer.Option("--grads", help="Gradients allocated before the step (resident) or made by it (fresh)."),
    ] = Grads.resident,
    protocol: Annotated[
        Protocol,
        typer.Option(
            "--protocol", help="default: this project's step; paper: the paper's script (transformers 4.51)."
        ),
    ] = Protocol.default,
    attn: opt.AttnOption = opt.Attn.auto,
    objective: opt.ObjectiveOption = opt.Objective.sft,
    lora_rank: opt.LoraRank = 0,
    optimizer: Annotated[
        str, typer.Option("--optimizer", help="none (backprop only) or adamw (a full training step).")
    ] = "none",
    as_json: opt.Json = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also upsert one row per method (metric max_len) into this results CSV."),
    ] = None,
) -> None:
    """Search every method's maximum length and print it (help text: `HELP`)."""
    from streambp_bench import max_len_report as report
    from streambp_bench.max_len import make_plan, run_plan

    plan = make_plan(
        model,
        method,
        device,
        budget_gib,
        batch_size=batch_size,
        dtype=dtype.value,
        partition_size=ps,
        head_partition_size=ps_head,
        grads=grads.value,
        protocol=protocol.value,
        attn=attn.value,
        training={"objective": objective.value, "lora_rank": lora_rank, "optimizer": optimizer},
    )
    columns = (SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn())
    with Progress(*columns, console=Console(stderr=True), transient=True) as progress:
        try:
            results = run_plan(plan, report.ProgressView(plan, progress))
        except RuntimeError as error:  # a measured probe that failed for another reason than OOM
            progress.stop()
            print_error(error)
            raise typer.Exit(code=1) from None
    if out is not None:
        report.write_rows(plan, results, out)
    if as_json:
        typer.echo(json.dumps(report.to_dict(plan, results), indent=2))
        return
    report.print_report(plan, results, out)
