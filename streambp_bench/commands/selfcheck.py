"""`streambp-bench selfcheck`: the one prepared GPU check (a CPU dry run of the same code without one)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console

HELP = (
    "Check the GPU path in a few minutes: bf16 gradients of every method and objective against the "
    "2x-plain-error rule, measured peak memory next to the simulator's prediction, step time of "
    "streambp (LM-head partitions 100 and 1024) vs checkpoint, and one profiled step of each at the "
    "longest length, kernel time by class. Writes [bold]selfcheck.csv[/] into --out and prints a "
    "summary.\n\n"
    "Without a GPU it says so and runs the same code paths on CPU with a tiny preset (exit 0)."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench selfcheck[/]    (results/gpu/selfcheck.csv)

[cyan]streambp-bench selfcheck --out /tmp/check --skip-time --skip-profile[/]
"""


@user_errors
def selfcheck(
    out: Annotated[Path, typer.Option("--out", "-o", help="Folder for selfcheck.csv.")] = Path("results/gpu"),
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Skip the bf16 gradient check.")] = False,
    skip_memory: Annotated[bool, typer.Option("--skip-memory", help="Skip the memory comparison.")] = False,
    skip_time: Annotated[bool, typer.Option("--skip-time", help="Skip the step-time comparison.")] = False,
    skip_profile: Annotated[bool, typer.Option("--skip-profile", help="Skip the kernel profile.")] = False,
    as_json: opt.Json = False,
) -> None:
    """Run the self-check (see the command help)."""
    from streambp_bench import selfcheck as check
    from streambp_bench.results import ResultsFile
    from streambp_bench.selfcheck_report import print_summary

    console = stderr_console()
    plan = check.default_plan()
    if plan.device == "cpu":
        console.print("[yellow]No CUDA device: a CPU dry run of the same code paths (tiny preset).[/]")
    where = check.device_name(plan)
    results = ResultsFile(out / ("selfcheck.csv" if plan.device == "cuda" else "selfcheck-cpu-dry-run.csv"))
    steps = [("verify", skip_verify, lambda: check.verify_rows(plan, where))]
    model = None if (skip_memory and skip_time and skip_profile) else check.memory_model(plan)
    steps += [("memory", skip_memory, lambda: check.memory_rows(plan, model, where)),
              ("time", skip_time, lambda: check.time_rows(plan, model, where)),
              ("profile", skip_profile, lambda: check.profile_rows(plan, model, where))]
    for name, skipped, make_rows in steps:
        if skipped:
            continue
        with console.status(f"selfcheck: {name} on {where} ..."):
            for row in make_rows():
                results.upsert(row)
        console.print(f"[green]done[/] {name}")
    frame = results.load() if results.path.exists() else None
    outcome = {"failed": frame is not None and bool((frame["status"] == "error").any())}
    document = {"device": where, "csv": str(results.path), "failed": outcome["failed"],
                "rows": [] if frame is None else frame.to_dict(orient="records")}

    def render(stdout) -> None:
        outcome["failed"] = print_summary(stdout, frame, where)
        stdout.print(f"rows written to {results.path}")

    emit(document, as_json, render)
    if outcome["failed"] and plan.device == "cuda":
        raise typer.Exit(code=1)
