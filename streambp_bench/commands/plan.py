"""`streambp-bench plan`: the fastest recipe that fits a model, a cluster and a length, and how to run it."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.maxlen import sequence
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import method_list, writable_folder
from streambp_bench.tokens import UNITS, parse_tokens
from streambp_bench.workers import start_server, stop_server, worker_count
from streambp_core.config import ConfigError, check_budget_gib
from streambp_core.models.config_file import precheck_model

HELP = (
    "Search every recipe the simulator covers (method and streambp's head mode, FSDP2 zero2/zero3 or "
    "DeepSpeed ZeRO-2/3 or one GPU, sequence-parallel degree, offload tiers) and rank those that fit in "
    "GPU and host memory by estimated step time, fastest first; then the nearest misses and why.\n\n"
    "Each recipe runs at the largest partitions that fit (as [bold]max-len --ps auto --ps-head auto "
    "--at[/] gives them), its peak and host pool simulated at full depth, its time estimated with a band "
    "and what bounds it (GEMM-, attention-, PCIe-, collective-bound). [bold]--seq-len max[/] (the "
    "default): each recipe's longest length, as [bold]max-len[/] finds it, and its step time there.\n\n"
    "Pruned by monotonicity: a recipe that fails at the smallest partitions fails at larger ones; more "
    "offload tiers never shorten (the tiers are searched as a ladder: none, checkpoints, "
    "checkpoints+optimizer, all); a stage that fails makes the weaker stages fail (zero3 before zero2); "
    "a rung already at the largest partitions makes the rungs above it slower (dominated). Chains of "
    "recipes run side by side, one worker process per core.\n\n"
    "[bold]--emit DIR[/] writes what runs the chosen recipe ([bold]--pick K[/], 1 = the fastest): an "
    "accelerate config (FSDP2, or the DeepSpeed plugin with its ZeRO JSON), train.py (TRL's trainer "
    "for --objective with stream_trainer) and launch.sh."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench plan -m tiny/qwen3 --gpus 2 --gpu-model h100 --seq-len 4k --budget-gib 0.05[/]

[cyan]streambp-bench plan -m Qwen/Qwen3-8B --gpus 8 --gpu-model h100 --seq-len 256k[/]

[cyan]streambp-bench plan -m Qwen/Qwen3-8B --gpus 1 --gpu-model h100[/]    (each recipe's longest)

[cyan]streambp-bench plan -m Qwen/Qwen3-8B --gpus 8 --seq-len 1M --json --emit run/ --pick 1[/]
"""


def _length(text: str) -> int | None:
    """`--seq-len`: a token count, or None for max (ConfigError otherwise)."""
    return None if text.strip().lower() == "max" else parse_tokens(text, "--seq-len", minimum=2)


@user_errors
@opt.step_options("objective", "lora_rank", "batch_size", optimizer="adamw")
def plan(
    model: opt.Model = "Qwen/Qwen3-8B",
    gpus: Annotated[int, typer.Option("--gpus", min=1, help="GPUs of the cluster.")] = 1,
    gpu_model: Annotated[opt.GpuModelName, typer.Option("--gpu-model", help="The GPUs' model: its memory "
                                                         "is the budget, its datasheet the step time."
                                                         )] = opt.GpuModelName.h100,
    seq_len: Annotated[str, typer.Option("--seq-len", "-T", help=f"Tokens per sequence ({UNITS}), or max: "
                                         "each recipe's longest.")] = "max",
    gpus_per_node: sequence.GpusPerNodeOption = sequence.DEFAULT_GPUS_PER_NODE,
    host_gib: Annotated[float | None, typer.Option("--host-gib", help="Host memory per node in GiB the "
                                                   "offload tiers may take. Default: unbounded, reported."
                                                   )] = None,
    method: opt.Methods = "all",
    budget_gib: Annotated[float | None, typer.Option("--budget-gib", help="GPU memory in GiB per GPU; "
                                                     "default: the GPU model's.")] = None,
    jobs: opt.Jobs = None,
    emit_dir: Annotated[Path | None, typer.Option("--emit", help="Write the chosen recipe's accelerate "
                                                  "config, train.py and launch.sh into this folder.")] = None,
    pick: Annotated[int, typer.Option("--pick", min=1, help="With --emit: the K-th fastest recipe.")] = 1,
    as_json: opt.Json = False,
    **step: object,
) -> None:
    """Rank the recipes that fit (help text: `HELP`; the step's options, `step`: `options.STEP_OPTIONS`)."""
    from streambp_bench.recipes.space import GPU_MEMORY_GIB

    precheck_model(model)
    length = _length(seq_len)
    methods = method_list(method)
    budget = check_budget_gib(budget_gib) or GPU_MEMORY_GIB[gpu_model.value]
    check_budget_gib(host_gib, "--host-gib")
    fields = opt.step_fields(step)
    if emit_dir is not None:
        writable_folder(emit_dir, "--emit")
    context = start_server(worker_count(jobs, 2 * len(methods), "sim"))
    try:
        from streambp_bench.recipes import run

        job = run.prepare(model, methods, gpus, gpu_model.value, length, budget, host_gib, gpus_per_node,
                          fields)
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                      console=stderr_console(), transient=True) as progress:
            document = run.search(job, progress, worker_count(jobs, len(job.chains), "sim"), context)
    finally:
        stop_server(context)
    if not document["ranking"]:
        nearest = document["misses"][0]["why"] if document["misses"] else "every recipe is refused"
        raise ConfigError(f"no recipe fits {budget:g} GiB per GPU: nearest miss: {nearest}")
    if emit_dir is not None:
        from streambp_bench.recipes.launch import write_launch

        document["emitted"] = write_launch(emit_dir, document, pick)

    def render(console) -> None:
        from streambp_bench.recipes.report import render as render_tables

        render_tables(console, document)
        if "emitted" in document:
            console.print(f"wrote {', '.join(document['emitted']['files'])} (recipe #{pick})")
    emit(document, as_json, render)
