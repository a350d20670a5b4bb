"""What `streambp-bench selfcheck` does once its input is checked: list the plan (`show_plan`), run it
(`run`: the GPU plan on CUDA, the CPU-capable items on a tiny preset otherwise), or run its logic with
stand-ins (`dry_run`). Rows go to the results file as they are made (`plan.Runner`)."""

from __future__ import annotations

import tempfile
from pathlib import Path

import typer
from rich.console import Console

from streambp_bench.output import emit
from streambp_bench.results import ResultsFile, rows_to_frame
from streambp_bench.selfcheck import check
from streambp_bench.selfcheck.estimate import BUDGET_MINUTES
from streambp_bench.selfcheck.items import Context, plan_items
from streambp_bench.selfcheck.plan import Outcome, Runner, check_dry_run, stand_in, total_minutes
from streambp_bench.selfcheck.report import plan_table, print_items, print_summary
from streambp_core.config import ConfigError

CSV_NAMES = {"cuda": "selfcheck.csv", "cpu": "selfcheck-cpu-dry-run.csv",
             "dry-run": "selfcheck-plan-dry-run.csv"}
PLAN_BASIS = ("estimated from the committed H200 rows (results/gpu/selfcheck-h200.csv): step times fitted "
              "per method as a*T + b*T^2 at 8k and 16k, times the plan's steps, plus model builds, process "
              "starts and simulations (streambp_bench/selfcheck/estimate.py)")


def show_plan(skipped: set[str], as_json: bool) -> None:
    """The GPU plan's items (but `skipped`) with their estimated minutes on an H200, the total and the
    budget."""
    context = Context(check.GPU_PLAN, "plan")
    items = [item for item in plan_items(check.GPU_PLAN) if item.name not in skipped]
    listed = [{"item": item.name, "estimated_minutes": round(item.estimate_s(context) / 60, 2),
               "what": item.what} for item in items]
    total = total_minutes(items, context)
    document = {"items": listed, "total_minutes": round(total, 2), "budget_minutes": BUDGET_MINUTES,
                "source": "estimated", "basis": PLAN_BASIS}

    def render(console: Console) -> None:
        console.print(plan_table(listed, total, BUDGET_MINUTES))
        console.print(f"Minutes are {PLAN_BASIS}.", soft_wrap=True)

    emit(document, as_json, render)


def results_file(out: Path | None, device: str) -> ResultsFile | None:
    """The CSV the rows go to: selfcheck.csv in --out (default results/gpu) on CUDA, selfcheck-cpu-dry-run.csv
    in --out on a CPU, none on a CPU without --out."""
    folder = Path("results/gpu") if out is None and device == "cuda" else out
    if folder is None:
        return None
    results = ResultsFile(folder / CSV_NAMES[device])
    results.check_target()
    return results


def run(out: Path | None, skipped: set[str], as_json: bool, console: Console, emit_fn=emit) -> None:
    """Run the plan of this machine's device (module doc), print the summary; exit 1 when an item failed
    or, on CUDA, a bf16 check failed."""
    plan = check.default_plan()
    results = results_file(out, plan.device)
    if plan.device == "cpu":
        console.print("[yellow]No CUDA device: the items with a CPU form, on a tiny preset.[/]")
    where = check.device_name(plan)
    items = [item for item in plan_items(plan) if item.name not in skipped]
    not_run = [item.name for item in items if item.cuda_only and plan.device != "cuda"]
    if not_run:
        console.print(f"not run without CUDA: {', '.join(not_run)}")
    made: list = []

    def write(row) -> None:
        made.append(row)
        if results is not None:
            results.upsert(row)

    gpu_context = Context(check.GPU_PLAN, "plan")
    try:
        estimates = {item.name: item.estimate_s(gpu_context) for item in plan_items(check.GPU_PLAN)}
    except ConfigError as error:  # no estimates is no reason not to measure
        console.print(f"[yellow]no estimates: {error}[/]", soft_wrap=True)
        estimates = {}
    runner = Runner(write, plan.device, where, on_item=lambda outcome: _said(console, outcome),
                    on_start=lambda item: console.print(f"selfcheck: {item.name} on {where} ..."),
                    estimates_s=estimates, minutes_rows=plan.device == "cuda")
    outcomes = runner.run([item for item in items if item.name not in not_run], Context(plan, where))
    frame = results.load() if results is not None and results.path.exists() else None
    frame = rows_to_frame(made) if frame is None and made else frame
    state = {"failed": any(outcome.error for outcome in outcomes)}
    document = {"device": where, "csv": None if results is None else str(results.path),
                "items": [outcome.__dict__ for outcome in outcomes], "not_run": not_run,
                "rows": [] if frame is None else frame.to_dict(orient="records")}

    def render(stdout: Console) -> None:
        bf16_failed = print_summary(stdout, frame, where)
        state["failed"] |= bf16_failed and plan.device == "cuda"
        print_items(stdout, outcomes, where)
        stdout.print("rows not saved (give --out to keep them)" if results is None
                     else f"rows written to {results.path}")

    emit_fn(document, as_json, render)
    if as_json:
        state["failed"] |= plan.device == "cuda" and frame is not None and bool(
            ((frame.metric == "grad_rel_err") & (frame.status != "ok")).any())
    if state["failed"]:
        raise typer.Exit(code=1)


def _said(console: Console, outcome: Outcome) -> None:
    took = f"{outcome.seconds / 60:.2f} min (estimated {outcome.estimated_s / 60:.2f} on an H200)"
    if outcome.error:
        console.print(f"[red]failed[/] {outcome.name} after {took}: {outcome.error}", soft_wrap=True)
    else:
        console.print(f"[green]done[/] {outcome.name}: {outcome.rows} rows in {took}")


def dry_run(out: Path | None, skipped: set[str], fail: list[str], as_json: bool) -> None:
    """The GPU plan with stand-ins (`plan.stand_in`), written to selfcheck-plan-dry-run.csv in --out
    (replaced on each dry run) or a temporary folder, then checked (`plan.check_dry_run`); exit 1 with
    the problems when a check fails."""
    with tempfile.TemporaryDirectory(prefix="streambp-selfcheck-") as scratch:
        path = (out if out is not None else Path(scratch)) / CSV_NAMES["dry-run"]
        path.unlink(missing_ok=True)
        results = ResultsFile(path)
        context = Context(check.GPU_PLAN, "dry run")
        items = [item for item in plan_items(check.GPU_PLAN) if item.name not in skipped]
        late: list[str] = []

        def ended(outcome: Outcome) -> None:
            if not any(row.model == outcome.name for row in results.rows()):
                late.append(f"{outcome.name}: its rows were not in the file when it ended")

        runner = Runner(results.upsert, "cpu", "dry run", on_item=ended)
        outcomes = runner.run(items, context, stand_in(fail, "NVIDIA H200 (plan)"))
        problems = late + check_dry_run(items, context, outcomes, results.rows(), fail, BUDGET_MINUTES)
        _report_dry_run(items, context, outcomes, problems, path if out is not None else None, fail, as_json)
    if problems:
        raise typer.Exit(code=1)


def _report_dry_run(items, context, outcomes, problems, path, fail, as_json) -> None:
    total = total_minutes(items, context)
    document = {"items": [outcome.__dict__ for outcome in outcomes], "total_minutes": round(total, 2),
                "budget_minutes": BUDGET_MINUTES, "problems": problems,
                "csv": None if path is None else str(path)}

    def render(console: Console) -> None:
        print_items(console, outcomes, "dry run: stand-ins on the CPU")
        checks = ("items ran and ended in the plan's order", "each item's rows were in the file when it "
                  "ended", f"the failed stand-in ({', '.join(fail) or 'none asked'}) wrote its failed row "
                  "and the items after it ran",
                  f"estimated total {total:.1f} min within the {BUDGET_MINUTES:g}-minute budget")
        if problems:
            for problem in problems:
                console.print(f"[red]problem[/] {problem}", soft_wrap=True)
        else:
            for line in checks:
                console.print(f"[green]ok[/] {line}")
        console.print("rows not kept (give --out to keep them)" if path is None
                      else f"rows written to {path}")

    emit(document, as_json, render)
