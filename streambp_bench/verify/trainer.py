"""`streambp-bench verify trainer KIND`: a trainer's updates with `stream_trainer` against plain, per group.

The work is `streambp_core.verify.trainer_setup.run_parity` (one process) or, with `--nproc N
--engine fsdp2|deepspeed [--shard ...]`, `streambp_bench.verify.trainer_ranks.run_sharded_parity`
(N CPU ranks under accelerate's plugin); this module reads the trainer settings (`--set NAME=VALUE`),
refuses what a trainer check cannot run, and prints the table.
"""

from __future__ import annotations

import contextlib
import json
import math
import sys
from collections.abc import Callable
from typing import TypeVar

import typer
from rich.table import Table

from streambp_bench.errors import print_error
from streambp_bench.output import emit
from streambp_core.config import ConfigError

T = TypeVar("T")

POSITIVE_INT_SETTINGS = ("per_device_train_batch_size", "gradient_accumulation_steps", "num_generations")
"""--set fields that must be whole numbers of at least 1."""
NUMBER_SETTINGS = ("learning_rate", "weight_decay", "max_grad_norm", "adam_beta1", "adam_beta2",
                   "adam_epsilon", "warmup_ratio", "beta", "temperature", "epsilon")
"""--set fields that must be finite numbers."""


def parse_settings(pairs: list[str] | None) -> dict[str, object]:
    """{'weight_decay': 0.1, ...} from ['weight_decay=0.1', ...]: each value read as JSON when it parses
    (numbers, true/false, lists), else as text (e.g. optim=adamw_torch); ConfigError, before anything
    trains, for a NaN or infinite number and for a field of `POSITIVE_INT_SETTINGS` or `NUMBER_SETTINGS`
    whose value is not such a number."""
    settings: dict[str, object] = {}
    for pair in pairs or []:
        name, sep, text = pair.partition("=")
        if not sep or not name.strip():
            raise ConfigError(f"--set takes NAME=VALUE (a TrainingArguments or TRL config field): {pair!r}")
        try:
            value = json.loads(text)
        except json.JSONDecodeError:
            value = text
        settings[name.strip()] = _checked(name.strip(), value, text)
    return settings


def _checked(name: str, value: object, text: str) -> object:
    """`value` of `--set name=text` when it suits the field, else ConfigError naming both."""
    number = isinstance(value, int | float) and not isinstance(value, bool)
    if text.strip().lower().lstrip("+-") in ("nan", "inf", "infinity") or (
            number and not math.isfinite(value)):
        raise ConfigError(f"--set {name}={text}: a setting must be a finite number, not {text}")
    if name in POSITIVE_INT_SETTINGS and not (number and value == int(value) and value >= 1):
        raise ConfigError(f"--set {name}={text}: {name} must be a whole number of at least 1")
    if name in NUMBER_SETTINGS and not number:
        raise ConfigError(f"--set {name}={text}: {name} must be a number")
    return value


def run_trainer_parity(trainer: str, *, model: str, methods: tuple[str, ...], dtype: str, seq_len: int,
                       batch_size: int, ps: int, ps_head: int, seed: int, device: str, lora_rank: int,
                       attn: str, data: str, settings: list[str] | None, as_json: bool,
                       nproc: int | None = None, shard: str | None = None, engine: str = "fsdp2") -> bool:
    """Train `trainer` plain and with each method on `model` (on `nproc` ranks of `engine` when given);
    print each group's update error; whether every method is within tolerance."""
    import torch

    from streambp_core.verify.trainer_setup import GRPO_SETTINGS, ParitySetup, run_parity

    stages = _sharded_stages(nproc, shard, engine, device)
    if device not in ("cpu", "cuda"):
        raise ConfigError(f"--device {device}: a trainer check trains for real; use --device cpu or cuda")
    methods = tuple(m for m in methods if m != "plain") or ("checkpoint", "mst", "streambp")
    options = parse_settings(settings)
    group = options.get("num_generations", GRPO_SETTINGS["num_generations"]) if trainer == "grpo" else 1
    rows = batch_size * group  # -b: prompts per batch for grpo, each with its group of completions
    options = {"per_device_train_batch_size": rows, **options}
    quiet_libraries()
    setup = ParitySetup(trainer=trainer, model=model, dtype=getattr(torch, dtype), data=data,
                        lora_rank=lora_rank, seq_len_tokens=seq_len, seed=seed, device=device,
                        settings=options)
    stream = {"partition_size": ps, "head_partition_size": ps_head, "attn": attn}
    if stages:
        return _run_sharded(setup, methods, stream, nproc, engine, stages, as_json)
    results = _training(f"training {trainer} on {model}: plain, {', '.join(methods)} ...",
                        lambda: run_parity(setup, methods, **stream))
    document = {"source": f"measured-{device}", "trainer": trainer, "model": model, "dtype": dtype,
                "data": data, "lora_rank": lora_rank, "settings": options, "stream_options": stream,
                "results": [r.to_dict() for r in results]}
    emit(document, as_json, lambda console: _print(console, document, results))
    return all(r.ok for r in results)


def _training(status: str, run: Callable[[], T]) -> T:
    """`run()` under the progress line `status`, with what libraries print while they import or train
    (e.g. an accelerator probe) on stderr; a rank that fails or dies, or a reference that is itself
    broken (`BrokenReference`), is one line and exit code 1, as under `verify fsdp`."""
    from streambp_bench.verify.sharded import on_ranks
    from streambp_core.verify.trainer_parity import BrokenReference

    try:
        with contextlib.redirect_stdout(sys.stderr):
            return on_ranks(status, run)
    except BrokenReference as error:
        print_error(error)
        raise typer.Exit(code=1) from None


def quiet_libraries() -> None:
    """This process's datasets progress bars and transformers' info and warning lines off: stdout holds only
    the report (the trainers' own printed logs are removed by `parity_setup`)."""
    import datasets
    import transformers

    datasets.disable_progress_bars()
    transformers.logging.set_verbosity_error()


def _print(console, document: dict, results) -> None:
    table = Table(title=f"parameter updates vs plain {document['trainer']} training", title_justify="left")
    for column in ("method", "group", "update err", "tolerance", "worst parameter", "ok"):
        table.add_column(column, justify="right" if column in ("update err", "tolerance") else "left",
                         overflow="fold" if column == "worst parameter" else "ellipsis")
    for result in results:
        for group in result.groups:
            ok = group.rel_error <= result.tolerance
            table.add_row(result.method, group.group, f"{group.rel_error:.2e}", f"{result.tolerance:.0e}",
                          group.worst_parameter, "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    console.print(table)
    settings = ", ".join(f"{k}={v}" for k, v in document["settings"].items())
    console.print(f"{document['source']}: {document['model']}, {document['dtype']}, {document['data']} data, "
                  f"lora rank {document['lora_rank']}, {settings}; update err = ||update - update_plain|| / "
                  "||update_plain|| over each group's parameters after training", soft_wrap=True)
    ok = all(r.ok for r in results)
    console.print("[green]every method trains as plain does[/]" if ok
                  else "[bold red]some methods do not train as plain does[/]")


def _sharded_stages(nproc: int | None, shard: str | None, engine: str, device: str) -> tuple[str, ...]:
    """The stages a sharded trainer check runs (none without --nproc); ConfigError for what cannot run."""
    if nproc is None:
        if shard is not None:
            raise ConfigError("--shard needs --nproc N: the ranks to shard the model across")
        if engine != "fsdp2":
            raise ConfigError(f"--engine {engine} needs --nproc N: the ranks to shard the model across")
        return ()
    from streambp_bench.verify.deepspeed import sharded_stages

    if device != "cpu":
        raise ConfigError("verify trainer with --nproc runs cpu ranks (gloo); use --device cpu")
    return sharded_stages(engine, shard)


def _run_sharded(setup, methods, stream: dict, nproc: int, engine: str, stages, as_json: bool) -> bool:
    """`run_sharded_parity` for every stage (each checked before any rank starts); print; all passed."""
    from streambp_bench.verify.trainer_ranks import run_sharded_parity
    from streambp_core.verify.trainer_sharded import check_sharded

    for stage in stages:
        check_sharded(setup, engine, stage, methods)
    status = f"training {setup.trainer} on {nproc} {engine} ranks: {', '.join(stages)} ..."
    results = _training(status, lambda: [result for stage in stages for result in run_sharded_parity(
        setup, engine=engine, shard=stage, nproc=nproc, methods=methods, **stream)])
    document = {"source": "measured-cpu", "trainer": setup.trainer, "model": str(setup.model),
                "engine": engine, "nproc": nproc, "dtype": str(setup.dtype).removeprefix("torch."),
                "lora_rank": setup.lora_rank,
                "settings": setup.settings, "stream_options": stream,
                "results": [r.to_dict() for r in results]}
    emit(document, as_json, lambda console: _print_sharded(console, document, results))
    return all(r.ok for r in results)


def _print_sharded(console, document: dict, results) -> None:
    ranks = f"{document['nproc']} {document['engine']} ranks"
    title = f"parameter updates vs plain {document['trainer']} training, {ranks}"
    table = Table(title=title, title_justify="left")
    for column in ("method", "shard", "group", "vs reference", "tol", "vs plain on engine", "tol", "ok"):
        table.add_column(column, justify="right" if column.startswith(("vs", "tol")) else "left")
    for result in results:
        engine_errors = {g.group: g.rel_error for g in result.against_engine_plain.groups}
        for group in result.against_reference.groups:
            engine_error = engine_errors[group.group]
            reference, on_engine = result.against_reference.tolerance, result.against_engine_plain.tolerance
            ok = group.rel_error <= reference and engine_error <= on_engine
            table.add_row(result.against_reference.method, result.shard, group.group,
                          f"{group.rel_error:.2e}", f"{reference:.0e}", f"{engine_error:.2e}",
                          f"{on_engine:.0e}", "[green]pass[/]" if ok else "[bold red]FAIL[/]")
    console.print(table)
    references = sorted({r.reference for r in results})
    console.print(f"{document['source']}: {document['model']}, {document['dtype']}, {document['nproc']} gloo "
                  f"ranks; reference: {', '.join(references)} on the global batch; update err = ||update - "
                  "update_ref|| / ||update_ref|| over each group's parameters after training", soft_wrap=True)
    float64 = [r.float64_plain_error for r in results if r.float64_plain_error is not None]
    if float64:
        console.print("deepspeed keeps float32 master weights: against single-process float64 plain without "
                      f"an engine the largest group error is {max(float64):.2e} (measured-cpu, not judged)",
                      soft_wrap=True)
    for result in results:
        if result.reductions is not None:
            counts = ", ".join(f"{times} time(s) in {n}" for times, n in sorted(result.reductions.items()))
            console.print(f"{result.against_reference.method} {result.shard}: each (trainable parameter, "
                          f"micro-step) pair (step on zero1) reduced {counts} (measured-cpu, counted on "
                          "rank 0)",
                          soft_wrap=True)
    ok = all(r.ok for r in results)
    console.print("[green]every method trains as plain does[/]" if ok
                  else "[bold red]some methods do not train as plain does[/]")
