"""Options shared by the commands, each declared once.

The options of a training step are one table, `STEP_OPTIONS` (flags, the `StepSpec` field each sets, its
help, how its text is read); every command's Typer parameters (`step_options`) and every benchmark
script's argparse arguments (`add_step_arguments`) are generated from it, and `step_fields` turns the
values parsed into `StepSpec.of` fields in one call. The other shared options are `Annotated` aliases.
The choice Enums are generated from the core's tuples (`streambp_core.config`), so a choice added there
is a choice on the command line.
"""

from __future__ import annotations

import argparse
import inspect
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from streambp_bench.tokens import UNITS, BadValue, partitions, token_count
from streambp_core.config import (
    ATTN_BACKENDS,
    AUTO,
    DEVICES,
    DTYPES,
    FSDP_STAGES,
    GPU_MODEL_NAMES,
    GRADS_MODES,
    HEAD_MODES,
    OBJECTIVES,
    OPTIMIZERS,
    PADDINGS,
    PARTITION_FIELDS,
    PROTOCOLS,
    SHARD_MODES,
    ConfigError,
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
    """`--offload`'s tier set: none, a tier, a comma list of tiers or all (an unknown tier: a `BadValue`,
    one line from Typer or argparse); the default comes as a `Tiers` already."""
    if isinstance(text, Tiers):
        return text
    try:
        return Tiers.of(text)
    except TierError as err:
        raise BadValue(str(err)) from None


def _tiers_or_both(text: str | Tiers) -> Tiers | str:
    """`--offload`: the literal "both" (each method with and without checkpoints; `step_fields` refuses
    it where a command runs one tier set), else a tier set (`_tiers`)."""
    return "both" if isinstance(text, str) and text.strip() == "both" else _tiers(text)


F = TypeVar("F", bound=Callable[..., Any])

_OFFLOAD_HELP = (
    "Tiers in host memory, comma-separated (all = every one). checkpoints: what each method keeps between "
    "forward and backward, copied out in forward and back in backward (checkpoint: transformers' own "
    "checkpoint offload; mst + offload: the ALST single-GPU recipe, tiled MLP + tiled loss + checkpoint "
    "offload; streambp: each layer's input in pinned host memory, prefetched a layer ahead); optimizer: "
    "AdamW's states and fp32 master weights, the step run on the host (needs --optimizer adamw); params: "
    "the weights, each layer gathered for its forward and backward (with an optimizer, needs optimizer "
    "too); none: on the device. plain takes the optimizer tier only. both (max-len, sweep): each method "
    "with and without checkpoints (plain without only)."
)
_PARTITIONS = (f"{UNITS}), or auto: the largest whose simulated peak fits the budget (max-len, sweep). Where "
               "a command runs several, a comma list and/or START:STOP:STEP ranges (sweep's --ps).")


@dataclass(frozen=True)
class StepOption:
    """One option of a training step, declared once: its flags, the `StepSpec.of` field it sets, its help,
    and how its text is read: `kind` is what Typer reads (an Enum of the choices, or int), `parse` a
    parser of the text both Typer and argparse call (it returns the value; `kind` is then `object`)."""

    name: str
    flags: tuple[str, ...]
    field: str
    help: str
    kind: Any = int
    parse: Callable[[str], object] | None = None
    metavar: str | None = None
    default: object = None

    def parameter(self, default: object = None) -> inspect.Parameter:
        """This option as a keyword-only parameter of a Typer command, at `default` (else the table's)."""
        value = self.default if default is None else default
        if isinstance(self.kind, type) and issubclass(self.kind, Enum):
            value = self.kind(value)
        option = typer.Option(*self.flags, help=self.help, parser=self.parse, metavar=self.metavar)
        return inspect.Parameter(self.name, inspect.Parameter.KEYWORD_ONLY, default=value,
                                 annotation=Annotated[self.kind, option])

    def add_to(self, parser: argparse.ArgumentParser, default: object = None) -> None:
        """This option as an argument of an argparse `parser` (a benchmark script's), at `default`; a value
        `parse` reads stays text until `step_fields`, so a bad one is the script's one-line error."""
        enum = isinstance(self.kind, type) and issubclass(self.kind, Enum)
        parser.add_argument(*self.flags, dest=self.name, default=default, metavar=self.metavar,
                            type=str if enum or self.parse else self.kind,
                            choices=[member.value for member in self.kind] if enum else None,
                            help=self.help.replace("%", "%%"))


STEP_OPTIONS = {option.name: option for option in (
    StepOption("ps", ("--ps",), "partition_size", "Tokens per decoder-layer chunk (streambp partition size, "
               "mst chunk; " + _PARTITIONS, object, partitions("--ps"), "TOKENS", "500"),
    StepOption("ps_head", ("--ps-head",), "head_partition_size", "Tokens per LM-head and loss chunk "
               "(streambp; " + _PARTITIONS, object, partitions("--ps-head"), "TOKENS", "100"),
    StepOption("batch_size", ("--batch-size", "-b"), "batch_size", "Sequences (sft), group size (grpo) or "
               "pairs (dpo); >= 1.", default=1),
    StepOption("dtype", ("--dtype",), "dtype", "Precision of weights and compute.", Dtype,
               default="bfloat16"),
    StepOption("padding", ("--padding",), "padding", "No padding, or ~20% padding per row on the right or "
               "left.", Padding, default="none"),
    StepOption("seed", ("--seed",), "seed", "Seed of the random weights and tokens.", default=0),
    StepOption("objective", ("--objective",), "objective", "sft (cross-entropy), grpo (clipped policy "
               "gradient) or dpo.", Objective, default="sft"),
    StepOption("lora_rank", ("--lora-rank",), "lora_rank", "0: full-parameter gradients; R > 0: LoRA "
               "adapters of rank R.", default=0),
    StepOption("optimizer", ("--optimizer",), "optimizer", "none (backprop only) or adamw (a full training "
               "step).", Optimizer, default="none"),
    StepOption("attn", ("--attn",), "attn", "Attention kernel of a CUDA step: flash (flash-attn), sdpa, or "
               "auto; recorded in each result row. A simulated step runs the simulator's flash-like fake "
               "kernel whatever this is, a cpu step the exact CPU kernel.", Attn, default="auto"),
    StepOption("protocol", ("--protocol",), "protocol", "default: this project's step; paper: the paper's "
               "script (transformers 4.51: logits held through backward, GQA K/V expanded); backprop-only "
               "steps; trl: plain's and checkpoint's GRPO/DPO losses as TRL 0.17's trainers compute them "
               "(Table 3's).", Protocol, default="default"),
    StepOption("grads", ("--grads",), "grads", "Gradients allocated before the step (resident) or made by it "
               "(fresh); auto: fresh with an optimizer, else resident.", Grads, default="auto"),
    StepOption("head_mode", ("--head-mode",), "head_mode", "streambp's LM head: recompute (each chunk's "
               "logits again in backward; every objective), fused (each chunk's gradients in the forward "
               "pass: one head GEMM per chunk fewer, a vocab x hidden gradient buffer held from forward to "
               "backward; sft and grpo) or auto (fused where the objective allows it). Other methods have "
               "no streamed head.", HeadMode, default="recompute"),
    StepOption("offload", ("--offload",), "offload", _OFFLOAD_HELP, object, _tiers_or_both, "TIERS",
               Tiers.NONE),
)}
"""Every option of a training step, in the order a command's help lists them."""


def step_options(*names: str, **defaults: object) -> Callable[[F], F]:
    """Decorate a command `f(*, own..., **step)`: Typer sees its own parameters with the step options
    `names` and those in `defaults` (`STEP_OPTIONS`, in the table's order) before its --json, each at the
    table's default or the one given; their values arrive in `step` (`step_fields` reads them)."""
    chosen = {name: None for name in names} | defaults
    unknown = set(chosen) - set(STEP_OPTIONS)
    if unknown:
        raise ValueError(f"no step option {sorted(unknown)}")

    def decorate(command: F) -> F:
        own = [parameter.replace(kind=inspect.Parameter.KEYWORD_ONLY)  # Typer passes every one by name
               for parameter in inspect.signature(command, eval_str=True).parameters.values()
               if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
        named = [option.parameter(chosen[name]) for name, option in STEP_OPTIONS.items() if name in chosen]
        at = next((i for i, parameter in enumerate(own) if parameter.name == "as_json"), len(own))
        command.__signature__ = inspect.Signature([*own[:at], *named, *own[at:]])  # type: ignore[attr-defined]
        return command

    return decorate


def add_step_arguments(parser: argparse.ArgumentParser, **defaults: object) -> None:
    """Add the step options named in `defaults` (`STEP_OPTIONS`) to a benchmark script's `parser`, each at
    the default given (None: none given; the script says what it takes then)."""
    for name, default in defaults.items():
        STEP_OPTIONS[name].add_to(parser, default)


def step_fields(values: Mapping[str, object], *, listed: tuple[str, ...] = (), automatic: bool = True,
                both: bool = True) -> dict[str, object]:
    """`StepSpec.of` fields of the step options' `values` (by option name; a None value is left out; text
    an argparse script passed is parsed here). A partition option gives one size, or a tuple of sizes
    where it is `listed`; `automatic`: auto is taken (else refused: the command runs the sizes given);
    `both`: --offload both is taken. ConfigError, one line naming the flag, for what the command cannot
    take."""
    fields: dict[str, object] = {}
    for name, value in values.items():
        option = STEP_OPTIONS[name]
        if value is None:
            continue
        value = value.value if isinstance(value, Enum) else value
        if option.parse is not None:  # idempotent: a value Typer parsed passes as it is
            try:
                value = option.parse(value)
            except BadValue as error:
                raise ConfigError(str(error)) from None
        if option.field in PARTITION_FIELDS:
            value = _partition(option, value, listed=name in listed, automatic=automatic)
        if value == "both" and not both:
            raise ConfigError(f"{option.flags[0]} both: each method with and without checkpoints is "
                              "max-len's and sweep's; give one tier set")
        fields[option.field] = value
    return fields


def _partition(option: StepOption, sizes: object, *, listed: bool, automatic: bool) -> object:
    """One partition option's sizes (a tuple, `tokens.parse_partitions`) as the field's value."""
    sizes = sizes if isinstance(sizes, tuple) else (sizes,)
    flag = option.flags[0]
    if AUTO in sizes and not automatic:
        raise ConfigError(f"{flag} auto: the largest partitions that fit a budget are max-len's and sweep's "
                          "(simulated); this command runs the sizes given")
    if listed:
        return sizes
    if len(sizes) != 1:
        raise ConfigError(f"{flag} takes one size here, got {len(sizes)} ({', '.join(map(str, sizes))}); "
                          "a sweep takes a list")
    return sizes[0]


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
GpuModelOption = Annotated[
    GpuModelName | None,
    typer.Option("--gpu-model", help="Also estimate the step time on this GPU (roofline over the step's ops "
                 "from datasheet figures; with offload, plus the PCIe copies compute cannot hide at 64 GB/s "
                 "one way on H100/H200, 32 GB/s on A100/A800; labelled estimated)."),
]
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


def split_list(value: str) -> tuple[str, ...]:
    """'a, b,,c' -> ('a', 'b', 'c')."""
    return tuple(item.strip() for item in value.split(",") if item.strip())
