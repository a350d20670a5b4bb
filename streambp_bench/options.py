"""Options shared by the commands, defined once as `Annotated` aliases (defaults live on each command)."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer


class Dtype(str, Enum):
    """Floating-point precision of the model and the step."""

    float64 = "float64"
    float32 = "float32"
    bfloat16 = "bfloat16"


class Padding(str, Enum):
    """Where padding goes in each row of the random batch."""

    none = "none"
    right = "right"
    left = "left"


class Device(str, Enum):
    """Where the model runs."""

    cpu = "cpu"
    cuda = "cuda"


class Where(str, Enum):
    """Where max-len probes run: auto (cuda when present, else sim), cuda, cpu or sim."""

    auto = "auto"
    cuda = "cuda"
    cpu = "cpu"
    sim = "sim"


Model = Annotated[
    str,
    typer.Option(
        "--model",
        "-m",
        help="Preset name (see [bold]streambp-bench presets[/]) or a local directory with config.json.",
    ),
]
Methods = Annotated[
    str,
    typer.Option("--method", help="Comma-separated methods: plain, checkpoint, mst, streambp."),
]
SeqLen = Annotated[int, typer.Option("--seq-len", "-T", help="Tokens per sequence (>= 2).")]
BatchSize = Annotated[int, typer.Option("--batch-size", "-b", help="Sequences per batch (>= 1).")]
PartitionSize = Annotated[
    int, typer.Option("--ps", help="Tokens per decoder-layer chunk (streambp partition size, mst chunk).")
]
HeadPartitionSize = Annotated[int, typer.Option("--ps-head", help="Tokens per LM-head and loss chunk.")]
DtypeOption = Annotated[Dtype, typer.Option("--dtype", help="Precision of weights and compute.")]
PaddingOption = Annotated[
    Padding, typer.Option("--padding", help="No padding, or ~20% padding per row on the right or left.")
]
Seed = Annotated[int, typer.Option("--seed", help="Seed of the random weights and tokens.")]
DeviceOption = Annotated[Device, typer.Option("--device", help="cpu, or cuda when a GPU is present.")]
Json = Annotated[bool, typer.Option("--json", help="Print JSON on stdout instead of a table.")]


def split_list(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(item.strip() for item in value.split(",") if item.strip())


class Objective(str, Enum):
    """Training objective of the step."""

    sft = "sft"
    grpo = "grpo"
    dpo = "dpo"


class Attn(str, Enum):
    """Attention kernel on CUDA."""

    auto = "auto"
    sdpa = "sdpa"
    flash = "flash"


ObjectiveOption = Annotated[
    Objective, typer.Option("--objective", help="sft (cross-entropy), grpo (clipped policy gradient) or dpo.")
]
LoraRank = Annotated[
    int, typer.Option("--lora-rank", help="0: full-parameter gradients; R > 0: LoRA adapters of rank R.")
]
AttnOption = Annotated[
    Attn, typer.Option("--attn", help="Attention kernel on CUDA: flash (flash-attn), sdpa, or auto.")
]
