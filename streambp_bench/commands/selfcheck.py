"""`streambp-bench selfcheck`: the one prepared GPU check, item by item (`--plan` lists them, `--dry-run`
runs the plan's logic with stand-ins); without a GPU the CPU-capable items on a tiny preset."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.selfcheck.plan import ITEM_NAMES
from streambp_bench.specs import writable_folder
from streambp_core.config import ConfigError

HELP = (
    "Check the GPU path and measure every owed GPU row in one command (about 8 minutes on an H200; "
    "[bold]--plan[/] lists the items with their estimated minutes): bf16 gradients of every method and "
    "objective against the 2x-plain-error rule, and of every method on a tiny preset of each family with "
    "its own attention or state (gpt-oss, Gemma 2, Llama 4, DeepSeek-V3, Qwen3.5, Qwen3-Next); the blocked "
    "attention backward with sinks and windows and the soft-capped paths in bf16 by the same rule; the "
    "allocator's peak next to the simulator's for every "
    "method; checkpoint offload on Qwen3-1.7B at 64k and 256k tokens (allocator and pinned host peaks vs "
    "simulated, step time with and without); one FSDP2 rank on nccl at 16k vs the sharded simulation; the "
    "host tiers (optimizer, parameters) vs the simulated pools; max-len --device cuda vs the simulated "
    "search; streambp's blocked attention backward at 64k and 128k; step time and a kernel profile per "
    "LM-head partition. Each item writes its rows as it makes "
    "them into [bold]selfcheck.csv[/] in --out (default on a GPU: results/gpu, merged with the rows there), "
    "then a row with its minutes; a failed item writes a failed row and the plan goes on.\n\n"
    "Without a GPU it says so and runs the items that have a CPU form on a tiny preset (exit 0); that "
    "check writes nothing unless --out is given (then selfcheck-cpu-dry-run.csv in it). [bold]--dry-run[/] "
    "runs the GPU plan with each item's work replaced by a stand-in (one stand-in made to fail) and checks "
    "the order, the rows written as each item ends, the failure path and the time budget."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench selfcheck --plan[/]    (the items, their estimated H200 minutes and the total)

[cyan]streambp-bench selfcheck[/]    (on a GPU: results/gpu/selfcheck.csv; on a CPU: summary only)

[cyan]streambp-bench selfcheck --dry-run[/]    (the plan's logic on a CPU, in seconds)

[cyan]streambp-bench selfcheck --out /tmp/check --skip time --skip profile[/]
"""

CSV_NAMES = ("selfcheck.csv", "selfcheck-cpu-dry-run.csv", "selfcheck-plan-dry-run.csv")
"""The CSVs a run may write into --out (`selfcheck.session.CSV_NAMES`: which one depends on the device)."""


def _check_out(out: Path | None) -> None:
    """Before torch is imported: --out a writable folder, and every CSV a run may write there a results
    CSV of this schema or absent (which one depends on the device, not known yet)."""
    if out is None:
        return
    from streambp_bench.results import ResultsFile

    writable_folder(out)
    for name in CSV_NAMES:
        ResultsFile(out / name).check_target()


def _check_names(names: list[str], option: str) -> None:
    unknown = [name for name in names if name not in ITEM_NAMES]
    if unknown:
        raise ConfigError(f"{option}: unknown item {', '.join(unknown)}; items: {', '.join(ITEM_NAMES)}")


@user_errors
def selfcheck(
    out: Annotated[
        Path | None,
        typer.Option("--out", "-o", help="Folder for the CSV (default: results/gpu on a GPU; a CPU: none)."),
    ] = None,
    skip: Annotated[list[str] | None, typer.Option(
        "--skip", help=f"Leave an item out (repeatable): {', '.join(ITEM_NAMES)}.")] = None,
    plan_only: Annotated[bool, typer.Option(
        "--plan", help="List the GPU plan's items, their estimated H200 minutes and the total.")] = False,
    dry_run: Annotated[bool, typer.Option(
        "--dry-run", help="Run the GPU plan with stand-ins and check its logic (no GPU needed).")] = False,
    fail: Annotated[list[str] | None, typer.Option(
        "--fail", help="With --dry-run: the items whose stand-in fails (default: fsdp).")] = None,
    skip_verify: Annotated[bool, typer.Option("--skip-verify", help="Same as --skip verify.")] = False,
    skip_memory: Annotated[bool, typer.Option("--skip-memory", help="Same as --skip memory.")] = False,
    skip_time: Annotated[bool, typer.Option("--skip-time", help="Same as --skip time.")] = False,
    skip_profile: Annotated[bool, typer.Option("--skip-profile", help="Same as --skip profile.")] = False,
    skip_workspace: Annotated[bool, typer.Option("--skip-workspace", help="As --skip workspace.")] = False,
    as_json: opt.Json = False,
) -> None:
    """Run the self-check (see the command help)."""
    flags = {"verify": skip_verify, "memory": skip_memory, "time": skip_time, "profile": skip_profile,
             "workspace": skip_workspace}
    skipped = {*(skip or ()), *(name for name, on in flags.items() if on)}
    _check_names(sorted(skipped), "--skip")
    _check_names(list(fail or ()), "--fail")
    if fail and not dry_run:
        raise ConfigError("--fail makes a dry run's stand-in fail; give it with --dry-run")
    if plan_only and dry_run:
        raise ConfigError("--plan lists the plan and --dry-run runs it: give one of them")
    if skipped & set(fail or ()):
        raise ConfigError(f"--fail {', '.join(sorted(skipped & set(fail or ())))}: that item is skipped")
    _check_out(out)  # a bad --out is refused before torch is imported (well under a second)
    from streambp_bench.selfcheck import session

    if plan_only:
        session.show_plan(skipped, as_json)
    elif dry_run:
        default_fail = [name for name in ("fsdp", *ITEM_NAMES) if name not in skipped][:1]
        session.dry_run(out, skipped, list(fail) if fail else default_fail, as_json)
    else:
        session.run(out, skipped, as_json, stderr_console(), emit)
