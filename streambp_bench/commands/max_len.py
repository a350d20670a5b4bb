"""`streambp-bench max-len`: the longest sequence each method can back-propagate within a memory budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from streambp_bench import options as opt
from streambp_bench.errors import print_error, user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import sharding, step_specs, writable_results
from streambp_core.config import check_budget_gib

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
    "(output logits held through backward, GQA K/V expanded).\n\n"
    "[bold]--offload checkpoints[/] keeps what each method saves for backward in host memory (rows "
    "'+ offload'; 'mst + offload' is the ALST single-GPU recipe: tiled MLP + tiled loss + checkpoint "
    "offload); [bold]--offload both[/] searches each method with and without. The table then shows the "
    "host pool's peak and the GiB copied each way per step; [bold]--host-budget-gib[/] bounds the search "
    "by the host pool too (without it the host figure is reported, not bounded).\n\n"
    "[bold]--gpus N --shard STAGE[/] simulates one rank of N data-parallel GPUs (one sequence each): its "
    "shards of the weights, gradients and optimizer state, the layers it holds gathered, the gradients in "
    "flight and the buckets (zero2/zero3: torch FSDP2, what the engine runs; deepspeed-zero2: DeepSpeed "
    "ZeRO-2's allocations with bf16); the budget is per GPU."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench max-len[/]    (Qwen/Qwen3-8B, all methods, simulated, 80 GiB)

[cyan]streambp-bench max-len -m Qwen/Qwen3-14B --method checkpoint,streambp --json[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-8B --protocol paper --out results/maxlen.csv[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-8B --offload both[/]    (each method with and without offload)

[cyan]streambp-bench max-len --method streambp --offload checkpoints --host-budget-gib 256[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-4B --device cuda --budget-gib 40[/]

[cyan]streambp-bench max-len -m tiny/qwen3 --device cpu --budget-gib 0.01 --ps 64 --ps-head 32[/]

[cyan]streambp-bench max-len --optimizer adamw --gpus 8 --shard zero3 --method checkpoint,streambp[/]
"""


@user_errors
def max_len(
    model: opt.Model = "Qwen/Qwen3-8B",
    method: opt.Methods = "all",
    device: opt.DeviceOption = opt.Device.auto,
    budget_gib: opt.BudgetGib = None,
    ps: opt.PartitionSize = 500,
    ps_head: opt.HeadPartitionSize = 100,
    batch_size: opt.BatchSize = 1,
    dtype: opt.DtypeOption = opt.Dtype.bfloat16,
    grads: opt.GradsOption = opt.Grads.auto,
    protocol: opt.ProtocolOption = opt.Protocol.default,
    attn: opt.AttnOption = opt.Attn.auto,
    objective: opt.ObjectiveOption = opt.Objective.sft,
    lora_rank: opt.LoraRank = 0,
    optimizer: opt.OptimizerOption = opt.Optimizer.none,
    offload: opt.OffloadOrBothOption = opt.OffloadOrBoth.none,
    host_budget_gib: Annotated[
        float | None,
        typer.Option("--host-budget-gib", help="Host memory in GiB the offloaded checkpoints may take: "
                     "bounds the search too (default: reported, not bounded)."),
    ] = None,
    gpus: opt.Gpus = None,
    shard: opt.ShardOption = None,
    as_json: opt.Json = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also upsert one row per method (metric max_len) into this results CSV."),
    ] = None,
) -> None:
    """Search every method's maximum length and print it (help text: `HELP`)."""
    ranks, where = sharding(gpus, shard, device.value)
    specs = step_specs(
        model, method, batch_size=batch_size, dtype=dtype.value, partition_size=ps,
        head_partition_size=ps_head, grads=grads.value, protocol=protocol.value, attn=attn.value,
        objective=objective.value, lora_rank=lora_rank, optimizer=optimizer.value, offload=offload.value,
        **ranks,
    )  # every cheap check, before torch is imported
    check_budget_gib(budget_gib)
    check_budget_gib(host_budget_gib, "--host-budget-gib")
    results_file = writable_results(out)
    from streambp_bench import max_len_report as report
    from streambp_bench.max_len import make_plan, run_plan

    plan = make_plan(specs, where, budget_gib, host_budget_gib)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=stderr_console(), transient=True) as progress:
        try:
            results = run_plan(plan, report.ProgressView(plan, progress))
        except RuntimeError as error:  # a measured probe that failed for another reason than OOM
            progress.stop()
            print_error(error)
            raise typer.Exit(code=1) from None
    if results_file is not None:
        report.write_rows(plan, results, results_file)
    emit(report.to_dict(plan, results), as_json, lambda console: report.print_report(plan, results, out))
