"""`streambp-bench verify fsdp | sp | deepspeed`: every method's gradients across N ranks against
single-process plain, each engine its own subcommand with the options it reads."""

from __future__ import annotations

from typing import Annotated

import typer

from streambp_bench.commands.verify.grads import spec_from_options
from streambp_bench.commands.verify.options import STEP, Nproc, choices, takes
from streambp_bench.errors import user_errors
from streambp_bench.verify.deepspeed import DEEPSPEED_DEFAULT, sharded_stages
from streambp_core.config import FSDP_STAGES

FsdpStage = choices("FsdpStage", FSDP_STAGES)
ZeroStage = choices("ZeroStage", DEEPSPEED_DEFAULT)
ZeroOptimizer = choices("ZeroOptimizer", ("adam", "sgd"))

FSDP_HELP = (
    "Check every method across N ranks sharded with torch FSDP2 against single-process plain.\n\n"
    "Starts N ranks on this machine (gloo on CPU, nccl on CUDA: one GPU each), shards the model with torch "
    "FSDP2 (--shard zero2, zero3; both when not given) and compares every parameter's all-gathered "
    "gradient with single-process plain over the ranks' batches (each rank its own; the reference averages "
    "them), and counts each step's all-gathers and reduce-scatters (calls and bytes of the full tensors, "
    "per step and per FSDP unit: one per decoder layer plus the root). Full-parameter training in float64 "
    "or float32, unpacked rows, streambp's recomputing head, no offload. Exits 1 when a method fails or a "
    "rank dies, 2 on bad input."
)
FSDP_EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify fsdp -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero3 --method all[/]

[cyan]streambp-bench verify fsdp -m tiny/llama --dtype float64 --nproc 2 --padding right --json[/]
"""

SP_HELP = (
    "Check sequence parallelism (Ulysses): groups of S ranks share each sequence.\n\n"
    "Starts N ranks (gloo on CPU, nccl on CUDA) in groups of S, each rank computing its shard of the "
    "sequence; every method's gradients summed over the group are compared with single-process plain over "
    "the whole sequence, with each step's all-to-alls. With --shard zero2|zero3 the weights are sharded "
    "with FSDP2 over every rank too (else whole on each). Sequence parallelism does not run under "
    "DeepSpeed ZeRO. Exits 1 when a method fails or a rank dies, 2 on bad input."
)
SP_EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify sp -m tiny/llama --dtype float64 --nproc 2 --sp 2 --method all --padding right[/]

[cyan]streambp-bench verify sp -m tiny/llama --dtype float64 --nproc 2 --sp 2 --shard zero3[/]
"""

DEEPSPEED_HELP = (
    "Check every method under DeepSpeed ZeRO across N CPU ranks (gloo).\n\n"
    "Runs the user's DeepSpeed loop for one optimizer step on each stage (--shard zero1, zero2, zero3; all "
    "three when not given): the gradient ZeRO hands its optimizer against single-process plain's, the "
    "applied update against that optimizer's step on it, and how many times ZeRO reduced each parameter. "
    "With --padding each rank pads its rows differently (its own count of valid tokens). With --optimizer "
    "sgd (a client torch SGD) the update is also judged against single-process plain's SGD step, within "
    "float32's rounding of the write. A local config directory as -m checks an odd vocabulary or an "
    "untied head. Needs the deepspeed extra. Exits 1 when a method fails or a rank dies, 2 on bad input."
)
DEEPSPEED_EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify deepspeed -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero2[/]

[cyan]streambp-bench verify deepspeed -m tiny/llama --dtype float64 --nproc 2 --method streambp[/]

[cyan]streambp-bench verify deepspeed -m ./llama-vocab-211 --nproc 2 --optimizer sgd --padding right[/]
"""


@user_errors
@takes(*STEP, "padding", "device", "objective", "attn")
def fsdp(
    *,
    nproc: Nproc,
    shard: Annotated[
        FsdpStage | None, typer.Option("--shard", help="FSDP2 stage: zero2 or zero3 (both when not given).")
    ] = None,
    **options,
) -> None:
    """FSDP2 across `nproc` ranks (help text: `FSDP_HELP`)."""
    from streambp_bench.verify.sharded import run_sharded

    as_json = options.pop("as_json")
    stages = (shard.value,) if shard else FSDP_STAGES
    spec = spec_from_options(nproc=nproc, **options)
    _exit_on_failure(run_sharded(spec, nproc, stages, as_json=as_json))


@user_errors
@takes(*STEP, "padding", "device", "objective", "lora_rank", "attn", "head_mode", "offload")
def sp(
    *,
    nproc: Nproc,
    sp: Annotated[
        int, typer.Option("--sp", help="Ranks sharing each sequence (Ulysses); a divisor of --nproc.")
    ],
    shard: Annotated[
        FsdpStage | None, typer.Option("--shard", help="Also shard the weights with FSDP2 over every rank: "
                                       "zero2 or zero3 (whole on each rank when not given).")
    ] = None,
    **options,
) -> None:
    """Sequence parallelism in groups of `sp` across `nproc` ranks (help text: `SP_HELP`)."""
    from streambp_bench.verify.sequence import check_sequence_options

    check_sequence_options(sp, nproc)
    as_json = options.pop("as_json")
    spec = spec_from_options(nproc=nproc, **options)
    from streambp_bench.verify.sequence import run_sequence

    _exit_on_failure(run_sequence(spec, nproc, sp, shard.value if shard else None, as_json=as_json))


@user_errors
@takes(*STEP, "padding", "objective", "lora_rank")
def deepspeed(
    *,
    nproc: Nproc,
    shard: Annotated[
        ZeroStage | None, typer.Option("--shard", help="ZeRO stage: zero1, zero2 or zero3 (all three when "
                                       "not given).")
    ] = None,
    optimizer: Annotated[
        ZeroOptimizer, typer.Option("--optimizer", help="adam: torch's Adam from DeepSpeed's config (the "
                                    "update against plain's reported); sgd: a client torch SGD (judged).")
    ] = ZeroOptimizer.adam,
    **options,
) -> None:
    """DeepSpeed ZeRO across `nproc` CPU ranks (help text: `DEEPSPEED_HELP`)."""
    as_json = options.pop("as_json")
    stages = sharded_stages("deepspeed", shard.value if shard else None)
    spec = spec_from_options(nproc=nproc, **options)
    from streambp_bench.verify.deepspeed import run_deepspeed

    _exit_on_failure(run_deepspeed(spec, nproc, stages, as_json=as_json, optimizer=optimizer.value))


def _exit_on_failure(ok: bool) -> None:
    if not ok:
        raise typer.Exit(code=1)
