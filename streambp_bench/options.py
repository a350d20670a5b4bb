"""Options shared by the commands, defined once as `Annotated` aliases (defaults live on each command).

The choice Enums are generated from the core's tuples (`streambp_core.config`), so a choice added there
is a choice on the command line.
"""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from streambp_bench.tokens import UNITS, token_count
from streambp_core.config import (
    ATTN_BACKENDS,
    DEVICES,
    DTYPES,
    FSDP_STAGES,
    GPU_MODEL_NAMES,
    GRADS_MODES,
    HEAD_MODES,
    OBJECTIVES,
    OPTIMIZERS,
    PADDINGS,
    PROTOCOLS,
    SHARD_MODES,
)
from streambp_core.tiers import TierError, Tiers


def _choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum whose members are `values` (member name = value)."""
    return Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]


Dtype = _choices("Dtype", DTYPES)
Padding = _choices("Padding", PADDINGS)
Device = _choices("Device", ("auto", *DEVICES))
Objective = _choices("Objective", OBJECTIVES)
Attn = _choices("Attn", ATTN_BACKENDS)
Protocol = _choices("Protocol", PROTOCOLS)
Grads = _choices("Grads", ("auto", *GRADS_MODES))
Optimizer = _choices("Optimizer", OPTIMIZERS)
Shard = _choices("Shard", SHARD_MODES[1:])
Stage = _choices("Stage", FSDP_STAGES)
GpuModelName = _choices("GpuModelName", GPU_MODEL_NAMES)
HeadMode = _choices("HeadMode", HEAD_MODES)


def _tiers(text: str | Tiers) -> Tiers:
    """`--offload`'s tier set: none, a tier, a comma list of tiers or all (an unknown tier: typer's one-line
    bad-parameter error); the default comes as a `Tiers` already."""
    if isinstance(text, Tiers):
        return text
    try:
        return Tiers.of(text)
    except TierError as err:
        raise typer.BadParameter(str(err)) from None


def _tiers_or_both(text: str | Tiers) -> Tiers | str:
    """`--offload` where a command takes both: the literal "both" (each method with and without
    checkpoints), else a tier set (`_tiers`)."""
    return "both" if isinstance(text, str) and text.strip() == "both" else _tiers(text)


Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Preset name (see [bold]streambp-bench presets[/]) or a local directory with config.json.",
    ),
]
Models = Annotated[str, typer.Option("--model", "-m", help="Comma list of presets or local directories.")]
Methods = Annotated[
    str,
    typer.Option("--method", help="Comma list of plain, checkpoint, mst, streambp ('all': every one)."),
]
SeqLen = Annotated[
    int,
    typer.Option("--seq-len", "-T", metavar="TOKENS", parser=token_count("length"),
                 help=f"Tokens per sequence (>= 2; {UNITS})."),
]
BatchSize = Annotated[
    int, typer.Option("--batch-size", "-b", help="Sequences (sft), group size (grpo) or pairs (dpo); >= 1.")
]
PartitionSize = Annotated[
    int,
    typer.Option("--ps", metavar="TOKENS", parser=token_count("partition size"),
                 help=f"Tokens per decoder-layer chunk (streambp partition size, mst chunk; {UNITS})."),
]
HeadPartitionSize = Annotated[
    int,
    typer.Option("--ps-head", metavar="TOKENS", parser=token_count("head partition size"),
                 help=f"Tokens per LM-head and loss chunk ({UNITS})."),
]
AutoHeadPartitionSize = Annotated[
    str, typer.Option("--ps-head", help=f"Tokens per LM-head and loss chunk ({UNITS}), or auto: the largest "
                      "whose simulated peak fits the budget.")
]
GpuModelOption = Annotated[
    GpuModelName | None,
    typer.Option("--gpu-model", help="Also estimate the step time on this GPU (roofline over the step's ops "
                 "from datasheet figures; with offload, plus the PCIe copies compute cannot hide at 64 GB/s "
                 "one way on H100/H200, 32 GB/s on A100/A800; labelled estimated)."),
]
DtypeOption = Annotated[Dtype, typer.Option("--dtype", help="Precision of weights and compute.")]
PaddingOption = Annotated[
    Padding, typer.Option("--padding", help="No padding, or ~20% padding per row on the right or left.")
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random weights and tokens.")]
DeviceOption = Annotated[
    Device,
    typer.Option("--device", help="auto (cuda when present, else sim), sim (meta tensors), cpu or cuda."),
]
BudgetGib = Annotated[
    float | None,
    typer.Option("--budget-gib", help="Memory budget in GiB (2^30 B); default: the GPU's memory, else 80."),
]
Jobs = Annotated[
    int | None,
    typer.Option("--jobs", "-j", min=1, envvar="STREAMBP_BENCH_JOBS",
                 help="Worker processes for independent searches (default: one per core when simulated, "
                      "1 when measured)."),
]
Json = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of tables.")]
ObjectiveOption = Annotated[
    Objective, typer.Option("--objective", help="sft (cross-entropy), grpo (clipped policy gradient) or dpo.")
]
LoraRank = Annotated[
    int, typer.Option("--lora-rank", help="0: full-parameter gradients; R > 0: LoRA adapters of rank R.")
]
OptimizerOption = Annotated[
    Optimizer, typer.Option("--optimizer", help="none (backprop only) or adamw (a full training step).")
]
AttnOption = Annotated[
    Attn, typer.Option("--attn", help="Attention kernel on CUDA: flash (flash-attn), sdpa, or auto.")
]
ProtocolOption = Annotated[
    Protocol,
    typer.Option("--protocol", help="default: this project's step; paper: the paper's script (transformers "
                 "4.51: logits held through backward, GQA K/V expanded); backprop-only steps; trl: plain's "
                 "and checkpoint's GRPO/DPO losses as TRL 0.17's trainers compute them (Table 3's)."),
]
HeadModeOption = Annotated[
    HeadMode,
    typer.Option("--head-mode", help="streambp's LM head: recompute (each chunk's logits again in "
                 "backward; every objective), fused (each chunk's gradients in the forward pass: one head "
                 "GEMM per chunk fewer, a vocab x hidden gradient buffer held from forward to backward; sft "
                 "and grpo) or auto (fused where the objective allows it). Other methods have no streamed "
                 "head."),
]
GradsOption = Annotated[
    Grads,
    typer.Option("--grads", help="Gradients allocated before the step (resident) or made by it (fresh); "
                 "auto: fresh with an optimizer, else resident."),
]

_OFFLOAD_HELP = (
    "Tiers in host memory, comma-separated (all = every one). checkpoints: what each method keeps between "
    "forward and backward, copied out in forward and back in backward (checkpoint: transformers' own "
    "checkpoint offload; mst + offload: the ALST single-GPU recipe, tiled MLP + tiled loss + checkpoint "
    "offload; streambp: each layer's input in pinned host memory, prefetched a layer ahead); optimizer: "
    "AdamW's states and fp32 master weights, the step run on the host (needs --optimizer adamw); params: "
    "the weights, each layer gathered for its forward and backward (with an optimizer, needs optimizer "
    "too); none: on the device"
)
OffloadOption = Annotated[
    Tiers, typer.Option("--offload", parser=_tiers, metavar="TIERS",
                        help=_OFFLOAD_HELP + ". plain takes the optimizer tier only.")
]
OffloadOrBothOption = Annotated[
    object,  # a Tiers or "both" (typer takes one annotated type; the parser returns either)
    typer.Option("--offload", parser=_tiers_or_both, metavar="TIERS",
                 help=_OFFLOAD_HELP + "; both: each method with and without checkpoints (plain without "
                 "only). Asking plain for checkpoints or params is refused."),
]


def split_list(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(item.strip() for item in value.split(",") if item.strip())
Gpus = Annotated[
    int | None,
    typer.Option("--gpus", help="Simulate one rank of N GPUs (data parallel, one sequence each); needs "
                 "--shard. Simulated only."),
]
ShardOption = Annotated[
    Shard | None,
    typer.Option("--shard", help="How each rank holds the model state: zero2, zero3 (torch FSDP2, what the "
                 "engine runs), deepspeed-zero2 (DeepSpeed ZeRO-2's allocations, the paper's Table 4 "
                 "engine) or deepspeed-zero3. Needs --gpus."),
]
