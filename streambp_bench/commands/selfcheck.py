"""`streambp-bench selfcheck`: the one prepared GPU check (a CPU dry run of the same code without one)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import writable_folder

HELP = (
    "Check the GPU path in a few minutes: bf16 gradients of every method and objective against the "
    "2x-plain-error rule, measured peak memory next to the simulator's prediction, step time of "
    "streambp (LM-head partitions 100 and 1024) vs checkpoint, and one profiled step of each at the "
    "longest length, kernel time by class, and streambp's peak at 64k and 128k tokens with and without "
    "its blocked attention backward next to the simulator's (kernel workspace counted). Writes "
    "[bold]selfcheck.csv[/] into --out (default on a GPU: results/gpu, merged with the rows there) and "
    "prints a summary.\n\n"
    "Without a GPU it says so and runs the same code paths on CPU with a tiny preset (exit 0); that dry "
    "run writes nothing unless --out is given (then selfcheck-cpu-dry-run.csv in it)."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench selfcheck[/]    (on a GPU: results/gpu/selfcheck.csv; on a CPU: summary only)

[cyan]streambp-bench selfcheck --out /tmp/check --skip-time --skip-profile[/]
"""


def _results_file(out: Path | None, device: str):
    """The CSV the rows go to (checked before any work): selfcheck.csv in --out, default results/gpu on
    CUDA; selfcheck-cpu-dry-run.csv in --out on a CPU, none without --out."""
    from streambp_bench.results import ResultsFile

    folder = Path("results/gpu") if out is None and device == "cuda" else out
    if folder is None:
        return None
    results = ResultsFile(writable_folder(folder) / (
        "selfcheck.csv" if device == "cuda" else "selfcheck-cpu-dry-run.csv"))
    results.check_target()
    return results


@user_errors
def selfcheck(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the CSV (default: results/gpu on a GPU; a CPU: none)."),
    ] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Skip the bf16 gradient check.")] = False,
    skip_memory: Annotated[bool, typer.Option("--skip-memory", help="Skip the memory comparison.")] = False,
    skip_time: Annotated[bool, typer.Option("--skip-time", help="Skip the step-time comparison.")] = False,
    skip_profile: Annotated[bool, typer.Option("--skip-profile", help="Skip the kernel profile.")] = False,
    skip_workspace: Annotated[bool, typer.Option(
        "--skip-workspace", help="Skip the kernel-workspace check (long streambp steps).")] = False,
    as_json: opt.Json = False,
) -> None:
    """Run the self-check (see the command help)."""
    if out is not None:
        writable_folder(out)  # a bad --out is refused before torch is imported (well under a second)
    from streambp_bench.results import rows_to_frame
    from streambp_bench.selfcheck import check
    from streambp_bench.selfcheck.report import print_summary

    console = stderr_console()
    plan = check.default_plan()
    results = _results_file(out, plan.device)
    if plan.device == "cpu":
        console.print("[yellow]No CUDA device: a CPU dry run of the same code paths (tiny preset).[/]")
    where = check.device_name(plan)
    made: list = []
    steps = [("verify", skip_verify, lambda: check.verify_rows(plan, where))]
    no_model = skip_memory and skip_time and skip_profile and skip_workspace
    model = None if no_model else check.memory_model(plan)
    steps += [("memory", skip_memory, lambda: check.memory_rows(plan, model, where)),
              ("time", skip_time, lambda: check.time_rows(plan, model, where)),
              ("profile", skip_profile, lambda: check.profile_rows(plan, model, where)),
              ("workspace", skip_workspace, lambda: check.workspace_rows(plan, model, where))]
    for name, skipped, make_rows in steps:
        if skipped:
            continue
        with console.status(f"selfcheck: {name} on {where} ..."):
            for row in make_rows():
                made.append(row)
                if results is not None:
                    results.upsert(row)
        console.print(f"[green]done[/] {name}")
    frame = results.load() if results is not None and results.path.exists() else None
    frame = rows_to_frame(made) if frame is None and made else frame
    outcome = {"failed": frame is not None and bool((frame["status"] == "error").any())}
    document = {"device": where, "csv": None if results is None else str(results.path),
                "failed": outcome["failed"], "rows": [] if frame is None else frame.to_dict(orient="records")}

    def render(stdout) -> None:
        outcome["failed"] = print_summary(stdout, frame, where)
        stdout.print("rows not saved (give --out to keep them)" if results is None
                     else f"rows written to {results.path}")

    emit(document, as_json, render)
    if outcome["failed"] and plan.device == "cuda":
        raise typer.Exit(code=1)
