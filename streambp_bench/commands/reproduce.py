"""`streambp-bench reproduce ITEM`: regenerate one of the paper's figures or tables under results/."""

from __future__ import annotations

import dataclasses
import time
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer
from rich.console import Console
from rich.markup import escape
from rich.progress import Progress, SpinnerColumn, TaskID, TextColumn, TimeElapsedColumn

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import writable_folder
from streambp_bench.workers import PRELOAD, start_server, stop_server, worker_count
from streambp_core.config import ConfigError, available_cpus

HELP = (
    "Reproduce a figure or table of the StreamBP paper: run what it needs, write [bold]<item>.csv[/] and "
    "PNGs under --out, and regenerate [bold]<out>/README.md[/] with our numbers next to the paper's. "
    "An existing <item>.csv there keeps its rows (the item's rows are merged in, replacing equal points); "
    "the item's PNGs and README.md are replaced. --out is checked before any work.\n\n"
    "fig3: BP-only max length (simulated search) and memory-vs-length curves, Qwen3-8B, 14B, 32B LoRA r32. "
    "fig5: partition-size ablation of memory (simulated, Qwen3-8B, ps 500/1k/2k/5k). "
    "table1: step time — measured on a GPU (Qwen3-4B); without one, CPU-measured step time of a tiny model "
    "(a streambp/checkpoint ratio). table3: simulated max length with AdamW for SFT, GRPO (group 8), DPO. "
    "table4: simulated max length per rank across 3-8 GPUs (Qwen3-8B SFT with AdamW, ZeRO-2 as DeepSpeed "
    "allocates it and as torch FSDP2 does), plus ZeRO-3 for Qwen3-8B/14B/32B on 8 GPUs, with and without "
    "checkpoint offload. table6: gradient precision on the CPU "
    "(fp32 vs fp64, bf16 vs fp32). "
    "offload: max length of every method with and without checkpoints in host memory (Qwen3-8B, 14B, "
    "32B LoRA r32; 'mst + offload' is the ALST single-GPU recipe: tiled MLP + tiled loss + checkpoint "
    "offload) and device and host memory vs tokens up to 2M; and the host tiers: full fine-tuning with "
    "AdamW of Llama-3.1-8B and Qwen3-8B on one H100 80GB and one H200 141GB, each method with each tier "
    "set it can run, beside ALST's published single-GPU lengths, with the host GiB each needs (simulated). "
    "alst: Arctic Long Sequence Training's Llama-3.1-8B ladder, one H100 and one H200 to 32 H100s with "
    "Ulysses sequence parallelism, its recipe and streambp beside its published lengths (simulated; "
    "step times estimated). "
    "all: every item. Memory items are simulated everywhere; time items measure. An item's max-length "
    "searches run side by side, one worker process per core ([bold]--jobs[/] or STREAMBP_BENCH_JOBS).\n\n"
    "[bold]--check[/] writes nothing: it reruns each simulated item into a temporary folder and compares "
    "every row with the committed one of the same point under --out (exit 1 when one moved, is missing or "
    "is no longer produced), reads the measured items (table1, table6) without measuring again, and checks "
    "what the committed numbers claim: Table 4's checkpoint column within 15% of the paper at 4-8 GPUs, "
    "each GPU self-check file under <out>/gpu/ passed and its simulated peaks within 3% of the allocator's."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench reproduce fig3[/]    (under a minute on 2 CPU cores; results/fig3.csv and PNGs)

[cyan]streambp-bench reproduce offload[/]    (every method with and without offload)

[cyan]streambp-bench reproduce all --out results/[/]

[cyan]streambp-bench reproduce table6 --quick --out /tmp/r[/]    (tiny settings, seconds)

[cyan]streambp-bench reproduce fig3 --check[/]    (do results/fig3.csv's rows still come out? writes nothing)
"""


class Item(str, Enum):
    """A paper item."""

    fig3 = "fig3"
    fig5 = "fig5"
    table1 = "table1"
    table3 = "table3"
    table4 = "table4"
    table6 = "table6"
    offload = "offload"
    alst = "alst"
    all = "all"


ITEM_NAMES = tuple(item.value for item in Item if item is not Item.all)
"""Every item, in the order `all` runs them."""


@user_errors
def reproduce(
    item: Annotated[Item, typer.Argument(help="fig3, fig5, table1, table3, table4, table6, offload, alst "
                                                 "or all.")],
    out: Annotated[Path | None, typer.Option(
        "--out", "-o", help="Directory for CSVs, PNGs and README.md (default results/; --quick needs one).")
    ] = None,
    quick: Annotated[
        bool, typer.Option("--quick", help="Tiny models, budgets and lengths: a smoke test, not the paper's.")
    ] = False,
    check: Annotated[bool, typer.Option(
        "--check", help="Write nothing: rerun the simulated items and compare with the CSVs under --out; "
                        "check the committed numbers' claims. Exit 1 when one fails.")] = False,
    jobs: opt.Jobs = None,
    as_json: opt.Json = False,
) -> None:
    """Run the item(s), write CSV + PNG, regenerate README.md (help text: `HELP`); with --check, compare
    instead (`paper.check`)."""
    chosen = list(ITEM_NAMES) if item is Item.all else [item.value]
    if check and quick and _committed_results(Path("results") if out is None else out):
        raise ConfigError("--check --quick reruns at tiny settings, whose points the committed results/ "
                          "never holds (every row would fail): leave --quick out, or check a --quick --out "
                          "folder")
    if check:
        _check(chosen, Path("results") if out is None else out, quick, jobs, as_json)
        return
    if out is None and quick:
        raise ConfigError("--quick writes tiny smoke-test rows: give --out DIR (they must not be merged into "
                          "results/, where they would stand for the paper's settings)")
    if out is not None and quick and _committed_results(out):
        raise ConfigError(f"--quick writes tiny smoke-test rows: --out {out} is the checkout's results/, "
                          "where they would stand for the paper's settings; give another folder")
    out = Path("results") if out is None else out
    _check_out(out, chosen)
    workers = worker_count(jobs, available_cpus(), "sim")  # the searches are simulated everywhere
    context = start_server(workers, (*PRELOAD, "streambp_bench.paper.items"))  # overlaps the imports
    from streambp_bench.paper import readme
    from streambp_core.measure.cuda import cuda_available

    console = stderr_console()
    device = "cuda" if cuda_available() else "sim"
    if "table1" in chosen and device != "cuda":
        console.print(
            "table1 needs a GPU (none here): measuring CPU step-time ratios of a tiny model instead"
        )
    try:
        written, seconds = _run_items(chosen, out, quick, device, console, (workers, context))
    finally:
        stop_server(context)
    out.mkdir(parents=True, exist_ok=True)
    readme_path = out / "README.md"
    readme_path.write_text(readme.render(out), encoding="utf-8")
    files = [str(path) for path in [*dict.fromkeys(written), readme_path]]
    document = {"items": chosen, "out": str(out), "files": files, "seconds": seconds}
    emit(document, as_json, lambda stdout: [stdout.print(f"  {escape(f)}", soft_wrap=True) for f in files])


def _committed_results(out: Path) -> bool:
    """Whether `out` is a checkout's committed results/ folder, however it is spelled (relative to any
    folder, absolute, through a link): ./results, this package's checkout's, or a results/ beside a
    pyproject.toml."""
    folder = out.expanduser().resolve()
    checkout = Path(__file__).resolve().parents[2] / "results"
    return folder in (Path("results").resolve(), checkout) or (
        folder.name == "results" and (folder.parent / "pyproject.toml").is_file())


def _check(chosen: list[str], out: Path, quick: bool, jobs: int | None, as_json: bool) -> None:
    """`reproduce --check`: the findings of `paper.check` for each item, a table or JSON; exit 1 when one
    fails. --out must hold the committed CSVs; nothing is written there."""
    from streambp_bench.paper import check
    from streambp_bench.paper.items import ITEMS
    from streambp_bench.paper.shared import Settings
    from streambp_core.measure.cuda import cuda_available

    if not out.is_dir():
        raise ConfigError(f"--check compares with the CSVs under --out: {out} is not a folder")
    workers = worker_count(jobs, available_cpus(), "sim")
    rerun = [name for name in chosen if name not in check.MEASURED_ITEMS]
    context = start_server(workers, (*PRELOAD, "streambp_bench.paper.items")) if rerun else None
    device = "cuda" if cuda_available() else "sim"
    findings: list[check.Finding] = []
    console = stderr_console()
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=console, transient=True) as progress:
            for name in chosen:
                task = progress.add_task(f"{name}: checking ...", total=None)

                def note(text: str, name: str = name, task: TaskID = task) -> None:
                    progress.update(task, description=escape(f"{name}: rerun {text}"), refresh=True)

                def run(folder: Path, name: str = name, note=note) -> list[Path]:
                    return ITEMS[name].run(Settings(out_dir=folder, quick=quick, device=device, note=note,
                                                    jobs=workers, context=context))

                if name in check.MEASURED_ITEMS:
                    findings += check.measured(name, out)
                else:
                    findings += check.rerun(name, out, run)
                findings += check.data_checks(name, out)
                progress.remove_task(task)
    finally:
        stop_server(context)
    failed = [finding for finding in findings if not finding.ok]
    document = {"items": chosen, "out": str(out), "ok": not failed,
                "findings": [dataclasses.asdict(finding) for finding in findings]}

    def render(stdout: Console) -> None:
        for finding in findings:
            mark = "[green]ok[/]  " if finding.ok else "[red]FAIL[/]"
            stdout.print(f"{mark} {finding.item} {finding.check}: {escape(finding.detail)}", soft_wrap=True)
        stdout.print(f"{len(failed)} of {len(findings)} checks failed" if failed
                     else f"all {len(findings)} checks passed")

    emit(document, as_json, render)
    if failed:
        raise typer.Exit(code=1)


def _run_items(chosen: list[str], out: Path, quick: bool, device: str, console: Console,
               workers: tuple[int, Any]) -> tuple[list[Path], dict[str, float]]:
    """Run each item under a progress line on stderr, its searches on `workers` (count, fork-server
    context); (files written, seconds per item)."""
    from streambp_bench.paper.items import ITEMS
    from streambp_bench.paper.shared import Settings

    written: list[Path] = []
    seconds: dict[str, float] = {}
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=console, transient=True) as progress:
        for name in chosen:
            start = time.perf_counter()
            task = progress.add_task(f"{name} ...", total=None)

            def note(text: str, name: str = name, task: TaskID = task) -> None:
                progress.update(task, description=escape(f"{name}: {text}"), refresh=True)

            settings = Settings(out_dir=out, quick=quick, device=device, note=note, jobs=workers[0],
                                      context=workers[1])
            written += [settings.out_dir / f"{name}.csv", *ITEMS[name].run(settings)]
            seconds[name] = time.perf_counter() - start
            progress.remove_task(task)
            progress.console.print(f"{name}: done in {seconds[name]:.0f} s")
    return written, seconds


def _check_out(out: Path, chosen: list[str]) -> None:
    """Before any work: --out is a writable folder, each item's CSV there is a results CSV (its rows are
    kept and merged), and README.md is a file (ConfigError, SchemaError)."""
    from streambp_bench.results import ResultsFile

    writable_folder(out)
    for name in chosen:
        ResultsFile(out / f"{name}.csv").check_target()
    if (out / "README.md").is_dir():
        raise ConfigError(f"{out / 'README.md'} is a folder; reproduce writes its README.md there")
