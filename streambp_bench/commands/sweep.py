"""`streambp-bench sweep`: peak memory (and measured step time) over a grid, one CSV row per point."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
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
from streambp_bench.errors import user_errors
from streambp_bench.maxlen import packing as packing_note
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import method_list, sharding, spec_label, with_offload, writable_results
from streambp_bench.tokens import UNITS, parse_token_list
from streambp_core.config import ConfigError, StepSpec, check_budget_gib
from streambp_core.models.config_file import precheck_model

if TYPE_CHECKING:
    from streambp_bench.results import ResultRow

HELP = (
    "Run a grid of training steps and write one results row per point: the peak memory and the memory "
    "by category (weights, grads, optimizer, checkpoints, K/V, logits, temporaries, kernel workspace); on "
    "cpu/cuda also the "
    "step time (median of 5 timed steps after 1 warm-up, wall clock) as a second row (metric step_time).\n\n"
    "[bold]--device sim[/] (the default without a GPU) simulates each step on meta tensors, every layer of "
    "the model (no extrapolation in depth); a simulated "
    "peak above --budget-gib is written with status oom. [bold]cpu[/] / [bold]cuda[/] run real steps.\n\n"
    "Each point is written as soon as it finishes (atomic rewrite of the CSV), so Ctrl-C or a kill loses "
    "no finished point; running the same sweep again skips the points already in the file (resume) and "
    "runs the rest. --force re-runs every point and replaces its rows. Lengths and partition sizes take a "
    "k suffix (k = 1000 tokens, the paper's unit and the plots': 4k = 4000) or ki (1024: 4ki = 4096), and "
    "ranges START:STOP:STEP (inclusive).\n\n"
    "Each row records the attention kernel (--attn), the step protocol and whether gradients existed "
    "before the step, so a sweep with another --attn is other points: it runs them, it does not skip "
    "them.\n\n"
    "[bold]--offload TIERS[/] keeps the tiers the option's help names in host memory; [bold]both[/] runs "
    "each point with and without. Each row records its offload, the host pool's peak "
    "(host_peak_gib) and the GiB copied each way (to_host_gib, to_device_gib).\n\n"
    "[bold]--ps auto[/] / [bold]--ps-head auto[/]: per point, the largest partitions whose simulated "
    "peak fits the budget (the paper's advice; rows record the sizes chosen). [bold]--gpu-model[/] adds "
    "a row per point, metric step_time, source estimated: a roofline estimate of the step on that GPU.\n\n"
    "[bold]--head-mode[/]: streambp's LM head, recorded in its rows (column head_mode): recompute (the "
    "default), fused (each chunk's gradients in the forward pass: one head GEMM per chunk fewer, one vocab "
    "x hidden gradient buffer more; sft and grpo) or auto (fused where the objective allows it). Rows of "
    "the two heads are different points."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench sweep --seq-len 4k:64k:4k --method checkpoint,streambp[/]    (Qwen/Qwen3-8B, simulated)

[cyan]streambp-bench sweep -m Qwen/Qwen3-8B --method streambp --ps 500,1k,2k,5k --seq-len 8k,32k,64k[/]

[cyan]streambp-bench sweep --method checkpoint,mst,streambp --offload both --seq-len 64k:512k:64k[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-4B --objective grpo -b 8 --lora-rank 32 --optimizer adamw[/]

[cyan]streambp-bench sweep -m tiny/llama --device cpu --dtype float32 --seq-len 256,512 --ps 64 --out r.csv[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-4B --device cuda --attn sdpa --seq-len 8k,16k --out sdpa.csv[/]

[cyan]streambp-bench sweep --optimizer adamw --gpus 8 --shard zero3 --seq-len 64k:256k:64k --out z3.csv[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-8B --method streambp --ps auto --ps-head auto --gpu-model h100[/]

[cyan]streambp-bench sweep -m Qwen/Qwen3-4B --method streambp --head-mode fused --seq-len 8k,16k,32k[/]
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
    return Progress(*columns, console=stderr_console(), transient=False)


def _describe(point: StepSpec, rows: list[ResultRow] | None) -> str:
    from streambp_core.measure.units import format_size

    where = f"{spec_label(point)} {point.model} T={point.seq_len_tokens:,}"
    if point.partitioned:
        where += f" ps={point.stream.partition_size}"
    if point.method == "streambp":
        where += f" head={point.stream.head_mode}"
    if rows is None:
        return f"{where}: already done"
    row = rows[0]
    if row.status == "error":
        return f"{where}: error"
    return f"{where}: {format_size((row.peak_allocated_gib or 0) * 2**30)} ({row.status})"


@user_errors
@opt.step_options("ps", "ps_head", "objective", "lora_rank", "optimizer", "batch_size", "dtype", "attn",
                  "protocol", "grads", "head_mode", "offload")
def sweep(
    seq_len: Annotated[
        str,
        typer.Option("--seq-len", "-T", help=f"Comma list and/or START:STOP:STEP ranges; {UNITS}"),
    ] = "4k:32k:4k",
    gpu_model: opt.GpuModelOption = None,
    method: opt.Methods = "checkpoint,streambp",
    model: opt.Models = "Qwen/Qwen3-8B",
    gpus: opt.Gpus = None,
    shard: opt.ShardOption = None,
    device: opt.DeviceOption = opt.Device.auto,
    budget_gib: Annotated[
        float | None, typer.Option("--budget-gib", help="Budget of a point (default: GPU memory, else 80).")
    ] = None,
    out: Annotated[Path, typer.Option("--out", "-o", help="Results CSV to upsert into.")] = Path(
        "sweep.csv"
    ),
    force: Annotated[bool, typer.Option("--force", help="Re-run points already in --out.")] = False,
    packing: packing_note.PackingOption = None,
    as_json: opt.Json = False,
    **step: object,
) -> None:
    """Run the grid and upsert its rows into --out (help text: `HELP`; the step's options, `step`:
    `options.STEP_OPTIONS`)."""
    from streambp_bench.sweep import grid

    check_budget_gib(budget_gib)
    ranks, where = sharding(gpus, shard, device.value)
    models = opt.split_list(model)
    if not models:
        raise ConfigError("give at least one model")
    for name in models:
        precheck_model(name)
    fields = opt.step_fields(step, listed=("ps",))
    offload = fields.pop("offload")
    points = grid.expand_grid(methods=method_list(method), models=models, seq_lens=parse_token_list(seq_len),
                              partition_sizes=fields.pop("partition_size"), **fields, **ranks)
    points = with_offload(tuple(points), offload, every_method=method.strip() == "all")
    packing = packing_note.check_packing(packing, max(point.seq_len_tokens for point in points), points)
    writable_results(out)
    from streambp_bench.results import ResultsFile
    from streambp_core.models.load import load_config

    configs = {name: load_config(name) for name in models}  # a model that cannot run is refused here
    from streambp_core.step.parts.target import resolve_target

    target = resolve_target(where, budget_gib, cpu_budget=False)
    points, refused = _without_refused(points, configs) if method.strip() == "all" else (points, ())
    resolve = _auto_partitions(target, points)
    gpu = None if gpu_model is None else _gpu(gpu_model.value)
    results = ResultsFile(out)
    counts = {"ran": 0, "skipped": 0, "failed": 0}
    with _progress() as progress:
        task = progress.add_task(f"sweep ({target.source})", total=len(points))

        def advance(point: StepSpec, rows: list[ResultRow] | None) -> None:
            counts["skipped" if rows is None else "ran"] += 1
            counts["failed"] += int(bool(rows) and rows[0].status == "error")
            progress.update(task, advance=1, description=escape(_describe(point, rows)))

        try:
            grid.run_points(points, target, results, force=force, on_point=advance, resolve=resolve, gpu=gpu)
        except KeyboardInterrupt:
            progress.stop()
            stderr_console().print(
                f"interrupted: {counts['ran']} points written to {escape(str(out))}; run the same command "
                "again to resume"
            )
            raise typer.Exit(code=130) from None
    heads = {"head_mode": head} if (head := _streambp_head(points)) else {}
    summary = {"out": str(out), "source": target.source, "points": len(points), **counts, **heads,
               "refused": [{"model": name, "method": method, "reason": why} for name, method, why in refused]}
    notes = packing_note.packing_notes(packing, list(points), gpu)
    if packing:
        summary["packing"] = packing_note.to_dict(notes)
    how = target.source + (f"; streambp head {head}" if head else "")

    def render(console) -> None:
        console.print(f"{counts['ran']} points run, {counts['skipped']} already done, {counts['failed']} "
                      f"failed ({how}); rows in {escape(str(out))}", soft_wrap=True)
        if notes:
            console.print(packing_note.render_table(notes))
        for name, method, why in refused:
            console.print(escape(f"{method}: refused: {why}" + (f" ({name})" if len(models) > 1 else "")),
                          soft_wrap=True)

    emit(summary, as_json, render)


def _without_refused(points: tuple[StepSpec, ...], configs: dict
                     ) -> tuple[tuple[StepSpec, ...], tuple[tuple[str, str, str], ...]]:
    """`--method all`'s points without those of a method their model's family cannot run
    (`methods.guards.family_refusals`: mst, on a baselines family whose pieces it lacks), and
    (model, method, why) of each method left out."""
    from streambp_core.methods.guards import family_refusals

    refusals = {name: family_refusals(config) for name, config in configs.items()}
    kept = tuple(point for point in points if point.method not in refusals[point.model])
    refused = tuple(dict.fromkeys((point.model, point.method,
                                   refusals[point.model][point.method].removeprefix(f"{point.method}: "))
                                  for point in points if point.method in refusals[point.model]))
    return kept, refused


def _streambp_head(points: tuple[StepSpec, ...]) -> str:
    """The LM head of the grid's streambp points (one objective and --head-mode: one head); '' without."""
    return next((point.stream.head_mode for point in points if point.method == "streambp"), "")


def _gpu(name: str):
    from streambp_core.step.estimate.roofline import gpu_model

    return gpu_model(name)


def _auto_partitions(target, points: tuple[StepSpec, ...]):
    """resolve(point, model) for `run_points`: a point's AUTO partitions the largest whose simulated peak
    fits the target's budget (`resolve_partitions`; a point nothing fits takes the smallest, `searched`,
    and is written oom); None when no point has any."""
    if not any(point.stream.automatic for point in points):
        return None
    if target.budget_bytes is None:
        raise ConfigError("--ps auto / --ps-head auto need a budget: give --budget-gib")
    from streambp_core.step.search.partitions import resolve_partitions, searched

    def resolve(point: StepSpec, model) -> StepSpec:
        try:
            return resolve_partitions(point, target.budget_bytes, model)
        except ConfigError:
            return searched(point)
    return resolve
