"""`streambp-bench max-len`: the longest sequence each method can back-propagate within a memory budget."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated

import typer
from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from streambp_bench import options as opt
from streambp_bench.errors import print_error, user_errors
from streambp_bench.maxlen import packing as packing_note
from streambp_bench.maxlen import sequence
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import sharding, step_specs, writable_results
from streambp_bench.tokens import UNITS, parse_tokens
from streambp_bench.workers import start_server, stop_server, worker_count
from streambp_core.config import ConfigError, check_budget_gib
from streambp_core.search import SEARCH_CAP_TOKENS

HELP = (
    "Find the longest sequence each method can back-propagate within a memory budget, and show where the "
    "memory goes at that length.\n\n"
    "[bold]--device sim[/] (the default without a GPU) runs the real training step on meta tensors on the "
    "CPU and tracks every allocation: weights are never materialised, so any preset works on a laptop. "
    "The step is simulated at two shallow depths made of whole periods of the model's layer pattern (2 "
    "and 3 decoder layers on a uniform model) and extrapolated linearly to the model's depth. "
    "[bold]--device cuda[/] measures the allocator's peak, one child process per probe (an OOM is a data "
    "point); [bold]--device cpu[/] measures real CPU tensors with the tracker (small models).\n\n"
    "Search: a secant-guided bracket, then secant/bisection until the bracket (longest length that fits, "
    "shortest that does not) is within max(1%, 128 tokens). "
    "Simulated searches run side by side, one worker process per core ([bold]--jobs[/], or "
    "STREAMBP_BENCH_JOBS); each gives the same answer as in one process.\n\n"
    "Protocol: random token ids without padding, weights and gradients in --dtype, gradients already "
    "allocated (--grads resident: a gradient-accumulation micro-step, as in the paper's Fig. 3) or not "
    "(--grads fresh); no optimizer. --protocol paper mimics the paper's script on transformers 4.51 "
    "(output logits held through backward, GQA K/V expanded).\n\n"
    "[bold]--offload TIERS[/] keeps the tiers the option's help names in host memory (rows '+ offload'; "
    "with the default --method all, plain, which has nothing to offload, is left out); [bold]--offload "
    "both[/] searches each method with and without. The table then shows the host pool's peak and the GiB "
    "copied each way per step; [bold]--host-budget-gib[/] bounds the search by the host pool too (without "
    "it the host figure is reported, not bounded).\n\n"
    "[bold]--gpus N --shard STAGE[/] simulates one rank of N data-parallel GPUs (one sequence each): its "
    "shards of the weights, gradients and optimizer state, the layers it holds gathered, the gradients in "
    "flight and the buckets (zero2/zero3: torch FSDP2, what the engine runs; deepspeed-zero2/-zero3: "
    "DeepSpeed ZeRO-2's or ZeRO-3's allocations with bf16); the budget is per GPU, "
    "[bold]--host-budget-gib[/] per node ([bold]--gpus-per-node[/], default 8: a rank's share is "
    "1/min(8, N) of it).\n\n"
    "[bold]--sp N[/]: Ulysses sequence parallelism over N of those ranks (ALST's multi-GPU protocol: "
    "--gpus N --sp N --shard zero3 --optimizer adamw --offload checkpoints,optimizer): one rank is simulated "
    "through the engine's sequence-parallel code path on meta tensors (its T/N tokens, its heads over every "
    "token, KV heads replicated when fewer than ranks), plus the all-to-all buffers; --gpu-model adds the "
    "all-to-all time.\n\n"
    "[bold]--ps auto[/] / [bold]--ps-head auto[/]: the search runs with the smallest partitions the "
    "automatic choice considers (64 tokens; they reach furthest), then reports the largest partitions that "
    "still fit at each maximum (the fastest: fewer, larger chunks); rows record those. [bold]--at[/] "
    "lengths: the largest partitions that fit there. [bold]--gpu-model[/]: each of those steps' time, "
    "estimated (roofline over its ops, datasheet figures); with offload tiers, the bytes copied each way, "
    "their PCIe time (64 GB/s one way on H100/H200, 32 GB/s on A100/A800) and the part compute does not "
    "hide, which the step time includes.\n\n"
    "[bold]--head-mode[/]: streambp's LM head. recompute (the default) recomputes each chunk's logits in "
    "backward; fused takes each chunk's gradients in the forward pass (one head GEMM per chunk fewer; a "
    "vocab x hidden gradient buffer held from forward to backward; sft and grpo); auto: fused where the "
    "objective allows it. The Step line, the JSON and each row name the head."
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

[cyan]streambp-bench max-len -m meta-llama/Llama-3.1-8B --method mst,streambp --optimizer adamw[/]
[cyan]    --gpus 8 --sp 8 --shard zero3 --offload checkpoints,optimizer[/]
[cyan]    --budget-gib 79.65 --host-budget-gib 1769[/]

[cyan]streambp-bench max-len --method streambp --ps auto --ps-head auto --at 32k,128k --gpu-model h100[/]

[cyan]streambp-bench max-len -m Qwen/Qwen3-4B --method checkpoint,streambp --head-mode fused[/]
"""


def _at_length(text: str) -> int:
    """One `--at` length in tokens: 2 up to the search cap (ConfigError otherwise, before any work)."""
    try:
        tokens = parse_tokens(text, "--at")
    except ConfigError:
        tokens = None
    if tokens is None or not 2 <= tokens <= SEARCH_CAP_TOKENS:
        raise ConfigError(f"--at: a length must be a number of tokens from 2 to {SEARCH_CAP_TOKENS:,} "
                          f"(k = 1000, ki = 1024), got {text!r}")
    return tokens


@user_errors
@opt.step_options("ps", "ps_head", "batch_size", "dtype", "grads", "protocol", "attn", "head_mode",
                  "objective", "lora_rank", "optimizer", "offload")
def max_len(
    model: opt.Model = "Qwen/Qwen3-8B",
    method: opt.Methods = "all",
    device: opt.DeviceOption = opt.Device.auto,
    budget_gib: opt.BudgetGib = None,
    gpu_model: opt.GpuModelOption = None,
    at: Annotated[str | None, typer.Option("--at", help=f"Comma list of lengths ({UNITS}): the partitions "
                                           "that fit at each, and the estimated step time.")] = None,
    host_budget_gib: Annotated[
        float | None,
        typer.Option("--host-budget-gib", help="Host memory in GiB the offloaded checkpoints may take (per "
                     "node with --gpus): bounds the search too. Default: host unbounded, said on every row "
                     "(table header 'host GiB (unbounded)', JSON host_bound 'unbounded'): the answer's "
                     "host GiB is what it needs, which may exceed the machine's RAM."),
    ] = None,
    gpus: opt.Gpus = None,
    shard: opt.ShardOption = None,
    sp: sequence.SpOption = None,
    gpus_per_node: sequence.GpusPerNodeOption = sequence.DEFAULT_GPUS_PER_NODE,
    jobs: opt.Jobs = None,
    packing: packing_note.PackingOption = None,
    as_json: opt.Json = False,
    out: Annotated[
        Path | None,
        typer.Option("--out", help="Also upsert one row per method (metric max_len) into this results CSV."),
    ] = None,
    **step: object,
) -> None:
    """Search every method's maximum length and print it (help text: `HELP`; the step's options, `step`:
    `options.STEP_OPTIONS`)."""
    ranks = sequence.sequence_fields(sp, gpus, device.value)
    shards, where = sharding(gpus, shard, device.value)
    ranks.update(shards)
    fields = opt.step_fields(step)  # every cheap check, before torch is imported
    specs = step_specs(model, method, fields.pop("offload"), **fields, **ranks)
    check_budget_gib(budget_gib)
    check_budget_gib(host_budget_gib, "--host-budget-gib")
    if host_budget_gib is not None and not any(spec.offload for spec in specs):
        raise ConfigError("--host-budget-gib bounds what the offload tiers hold in host memory, and no step "
                          "offloads anything: give --offload (checkpoints, optimizer, params or both)")
    packing = packing_note.check_packing(packing, SEARCH_CAP_TOKENS, specs)
    at_lengths = tuple(_at_length(length) for length in opt.split_list(at or ""))
    results_file = writable_results(out)
    workers = worker_count(jobs, len(specs), where)
    context = start_server(workers)  # its imports overlap with the ones below
    from streambp_bench.maxlen import auto, report
    from streambp_bench.maxlen.plan import check_refused, check_something_fits, make_plan, run_plan

    extras = auto.Extras(at_lengths=at_lengths, gpu=None if gpu_model is None else auto.gpu(gpu_model.value))
    try:
        per_node = sequence.ranks_per_node(gpus, gpus_per_node)
        plan = make_plan(specs, where, budget_gib, host_budget_gib, per_node,
                         every_method=method.strip() == "all")
        sequence.check_heads(specs, plan.resolved)
    except BaseException:
        stop_server(context)
        raise
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=stderr_console(), transient=True) as progress:
        try:
            results = run_plan(plan, report.ProgressView(plan, progress), workers=workers, context=context)
        except RuntimeError as error:  # a measured probe that failed for another reason than OOM
            progress.stop()
            print_error(error)
            raise typer.Exit(code=1) from None
        finally:
            stop_server(context)
    check_refused(results)
    check_something_fits(plan, results)
    steps: list = []
    extra = auto.active(plan, extras)
    if extra:
        with stderr_console().status("partitions and estimated step times"):
            results, steps = auto.finish(plan, results, extras)
    if results_file is not None:
        report.write_rows(plan, results, results_file, extra_rows=auto.estimated_rows(steps, extras))
    automatic = auto.automatic(plan)
    document = report.to_dict(plan, results) | (auto.to_dict(steps, extras, automatic) if extra else {})
    notes = packing_note.packing_notes(
        packing, [r.spec.at(r.search.max_len_tokens) for r in results if r.search.max_len_tokens >= 2],
        extras.gpu, {plan.specs[0].model: plan.resolved})
    if packing:
        document["packing"] = packing_note.to_dict(notes)

    def render(console) -> None:
        report.print_report(plan, results, out)
        if extra:
            console.print(auto.render_table(steps, extras, automatic))
        if notes:
            console.print(packing_note.render_table(notes))
    emit(document, as_json, render)
