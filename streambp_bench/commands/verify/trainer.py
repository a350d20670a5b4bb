"""`streambp-bench verify trainer KIND`: a trainer's parameter updates with `stream_trainer` against plain
training, per parameter group, in one process or on CPU ranks under accelerate's FSDP2 or DeepSpeed."""

from __future__ import annotations

from enum import Enum
from typing import Annotated

import typer

from streambp_bench import options as opt
from streambp_bench.commands.verify.options import STEP, choices, takes
from streambp_bench.errors import user_errors
from streambp_bench.specs import method_list
from streambp_bench.verify.deepspeed import ENGINES
from streambp_core.integrations.settings import PARITY_DATA_KINDS, TRAINER_KINDS
from streambp_core.models.config_file import precheck_model

TrainerKind = choices("TrainerKind", TRAINER_KINDS)
TrainerData = Enum("TrainerData", {kind.replace("-", "_"): kind for kind in PARITY_DATA_KINDS}, type=str)
Engine = choices("Engine", ENGINES)

HELP = (
    "Check training: a trainer's parameter updates with stream_trainer against plain training.\n\n"
    "Builds the model as a user does (from_pretrained for a directory with weights, else from_config with "
    "random weights), trains it with transformers' Trainer (KIND trainer) or TRL's trainer (sft, dpo, "
    "grpo) plain and with stream_trainer for each method (3 optimizer steps of SGD unless --set says "
    "otherwise; random words over the model's vocabulary as data) and prints each parameter group's update "
    "error, ||update - update_plain|| / ||update_plain||. Tolerance: 1e-10 in float64 (1e-4 in float32) "
    "with SGD, 1e4 x that with Adam-like optimizers, whose normalisation amplifies the rounding of "
    "near-zero gradients. The trainer pads its batches and computes its own loss.\n\n"
    "With [bold]--nproc N[/] the trainer runs on N CPU ranks under accelerate's FSDP2 or DeepSpeed plugin "
    "(--engine; gradient accumulation 2) and is compared with single-process plain and with plain on the "
    "engine. Exits 1 when a method trains otherwise than plain, a rank dies, or the reference itself "
    "trains to a non-finite update; 2 on bad input, a setting under which nothing trains (a zero learning "
    "rate, zero steps) included."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify trainer sft -m ./my-model-dir --dtype float64 --set weight_decay=0.1[/]

[cyan]streambp-bench verify trainer dpo -m tiny/qwen3 --dtype float64 -b 2 --lora-rank 8[/]

[cyan]streambp-bench verify trainer sft -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero3[/]

[cyan]streambp-bench verify trainer trainer -m tiny/qwen3 --dtype float64 --nproc 2 --engine deepspeed \
--shard zero2[/]
"""


@user_errors
@takes(*STEP, "device", "lora_rank", "attn")
def trainer(
    *,
    kind: Annotated[
        TrainerKind, typer.Argument(metavar="KIND", help="trainer (transformers' Trainer), sft, dpo or grpo "
                                    "(TRL's).")
    ],
    data: Annotated[TrainerData, typer.Option("--data", help="Text or prompt-completion rows.")
                    ] = TrainerData.text,
    settings: Annotated[
        list[str] | None, typer.Option("--set", help="A TrainingArguments / TRL config field, NAME=VALUE "
                                       "(repeat it), e.g. --set weight_decay=0.1.")
    ] = None,
    nproc: Annotated[
        int | None, typer.Option("--nproc", help="CPU ranks to train on under --engine (one process when "
                                 "not given); at most the CPU cores.")
    ] = None,
    engine: Annotated[
        Engine, typer.Option("--engine", help="With --nproc: accelerate's fsdp2 or deepspeed plugin.")
    ] = Engine.fsdp2,
    shard: Annotated[
        str | None, typer.Option("--shard", help="With --nproc: the engine's stage (fsdp2: zero2 or zero3, "
                                 "both when not given; deepspeed: zero1, zero2 or zero3, all three).")
    ] = None,
    **options,
) -> None:
    """Train `kind` plain and with each method (help text: `HELP`)."""
    from streambp_bench.verify.trainer import parse_settings, run_trainer_parity

    precheck_model(options["model"])
    parse_settings(settings)  # bad values refused before anything trains
    step = opt.step_fields({name: options[name] for name in ("ps", "ps_head", "dtype", "batch_size", "seed",
                                                            "lora_rank", "attn")}, automatic=False)
    if not run_trainer_parity(
            kind.value, model=options["model"], methods=method_list(options["method"]), dtype=step["dtype"],
            seq_len=options["seq_len"], batch_size=step["batch_size"], ps=step["partition_size"],
            ps_head=step["head_partition_size"], seed=step["seed"], device=options["device"].value,
            lora_rank=step["lora_rank"], attn=step["attn"], data=data.value, settings=settings,
            as_json=options["as_json"], nproc=nproc, shard=shard, engine=engine.value):
        raise typer.Exit(code=1)
