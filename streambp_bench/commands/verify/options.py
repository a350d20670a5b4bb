"""The options of `verify` and its subcommands, each defined once; a command names those it takes (`takes`),
so an option that does not apply to a check is not on that check's command line, rather than refused.

    @takes("model", "method", "dtype", "as_json")
    def fsdp(*, nproc: Nproc, **options) -> None: ...

Typer reads the command's own parameters and the named ones; the named ones arrive in `**options`.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from enum import Enum
from typing import Annotated, Any, TypeVar

import typer

from streambp_bench import options as opt
from streambp_core.config import VERIFY_METHODS

F = TypeVar("F", bound=Callable[..., Any])

DEFAULT_METHOD_LIST = ",".join(VERIFY_METHODS)

Nproc = Annotated[
    int, typer.Option("--nproc", help="Ranks to start; at most the CPU cores (cpu) or the GPUs (cuda).")
]
Packing = Annotated[
    str, typer.Option("--packing", metavar="DOCS", help="Packed rows (sft): a document count (3: random "
                      "lengths filling each row) or lengths (100,37,250; a shorter total pads the row's "
                      "end); position_ids restart per document and attention stays within each.")
]


def choices(name: str, values: tuple[str, ...]) -> type[Enum]:
    """A str Enum whose members are `values` (member name = value): an option's choices."""
    return Enum(name, {value: value for value in values}, type=str)  # type: ignore[return-value]


def _option(name: str, annotation: object, default: object) -> inspect.Parameter:
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, annotation=annotation, default=default)


def _step(name: str, default: object = None) -> inspect.Parameter:
    return opt.STEP_OPTIONS[name].parameter(default)


OPTIONS = {parameter.name: parameter for parameter in (
    _option("model", opt.Model, "Qwen/Qwen3-0.6B"),
    _option("method", opt.Methods, DEFAULT_METHOD_LIST),
    _option("seq_len", opt.SeqLen, 128),
    _step("batch_size"),
    _step("ps", "48"),
    _step("ps_head", "32"),
    _step("dtype", "float32"),
    _step("padding"),
    _step("seed"),
    _option("device", opt.DeviceOption, opt.Device.cpu),
    _step("objective"),
    _step("lora_rank"),
    _step("attn"),
    _step("head_mode"),
    _step("optimizer"),
    _step("offload"),
    _option("packing", Packing, ""),
)}
"""Every option of a verify check, in the order the help lists them (`--json` last)."""

STEP = ("model", "method", "seq_len", "batch_size", "ps", "ps_head", "dtype", "seed")
"""The options every verify check takes: the model and the step it runs."""


def takes(*names: str) -> Callable[[F], F]:
    """Decorate a command `f(*, own..., **options)`: Typer sees the `OPTIONS` named (in their order), then
    its own parameters, then `--json`; the named options arrive in `options` (`as_json` among them)."""
    unknown = set(names) - set(OPTIONS)
    if unknown:
        raise ValueError(f"no verify option {sorted(unknown)}")

    def decorate(command: F) -> F:
        own = [parameter for parameter in inspect.signature(command, eval_str=True).parameters.values()
               if parameter.kind is not inspect.Parameter.VAR_KEYWORD]
        named = [parameter for name, parameter in OPTIONS.items() if name in names]
        json = _option("as_json", opt.Json, False)
        command.__signature__ = inspect.Signature([*named, *own, json])  # type: ignore[attr-defined]
        return command

    return decorate
