"""`streambp-bench verify`: every method's gradients and loss against plain backprop, on one model, in one
process (the group's own check; its subcommands check across ranks and trainers)."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import typer
from rich.markup import escape
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)
from rich.table import Table

from streambp_bench import options as opt
from streambp_bench.commands.verify.options import STEP, takes
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import method_list
from streambp_core.config import VERIFY_METHODS, ConfigError, StepSpec
from streambp_core.models.config_file import precheck_model
from streambp_core.tiers import Tiers, tier_problem

if TYPE_CHECKING:
    from streambp_core.verify.methods import VerifyReport, VerifySpec

HELP = (
    "Check that each method's loss and every parameter gradient equal plain backprop's.\n\n"
    "Builds the model with random weights, runs one step of [bold]plain[/] as the reference and one step "
    "of each method on the same random tokens, then compares every parameter's gradient: "
    "grad err = max over parameters of ||g - g_plain|| / (||g_plain|| + sqrt(numel) * rms), rms = RMS of "
    "plain's gradient over all parameters (a relative and an absolute part, as torch.testing.assert_close)."
    "\n\n"
    "Tolerance: 1e-10 in float64, 1e-4 in float32 (the loss too, relative to max(1, |loss|)); the table "
    "prints both the gradient and the loss tolerance beside the errors. In bfloat16 and float16 "
    "the reference is plain in float32 on the same rounded weights, and a method passes when its error "
    "is at most 2x plain's in that precision. Progress goes to stderr. Exits 1 when a method fails, 2 on bad "
    "input.\n\n"
    "[bold]--offload checkpoints[/] runs each method with its checkpoints in host memory, through the real "
    "offload code path (on a CPU the host is the CPU: copies, no pinning); the check is the same, and "
    "offloading changes no bit of any gradient. [bold]--optimizer adamw[/] runs one AdamW step per method "
    "(float32, float64), so the host tiers run too ([bold]--offload optimizer[/]: AdamW stepped in host "
    "memory; [bold]params[/]: the weights there): the gradients AdamW receives and the update it applies "
    "(column update err) are both compared with plain's step with torch's AdamW on the device.\n\n"
    "[bold]--head-mode fused[/] checks streambp's fused LM head (each chunk's gradients taken in the "
    "forward pass; sft and grpo), [bold]auto[/] the head the objective allows (fused for sft and grpo); "
    "the default is the recomputing head.\n\n"
    "Without --method, checkpoint, mst and streambp are checked, and plain too when it takes the tiers "
    "(--offload optimizer: plain with AdamW on the host); where it cannot (checkpoints, params) a note under "
    "the table says plain was left out and why.\n\n"
    "The subcommands check the same across ranks and trainers, each with the options that apply to it: "
    "[bold]verify fsdp[/] (torch FSDP2), [bold]verify sp[/] (sequence parallelism), [bold]verify "
    "deepspeed[/] (DeepSpeed ZeRO) and [bold]verify trainer KIND[/] (transformers' Trainer and TRL's "
    "trainers); the options above go to this check only, so give a subcommand's options after its name."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify[/]    (Qwen/Qwen3-0.6B, float32, 128 tokens)

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --padding left -b 2[/]

[cyan]streambp-bench verify -m Qwen/Qwen3-8B --device cuda --dtype bfloat16[/]

[cyan]streambp-bench verify -m ./my-model-dir --method streambp --ps 64 --json[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --objective dpo -b 2 --lora-rank 8[/]

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --offload checkpoints[/]

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --optimizer adamw --offload all[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --objective grpo -b 2 --head-mode fused[/]

[cyan]streambp-bench verify -m tiny/mistral --dtype float64 --packing 100,37,250 --seq-len 400 -b 2[/]

[cyan]streambp-bench verify fsdp -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero3[/]

[cyan]streambp-bench verify sp -m tiny/llama --dtype float64 --nproc 2 --sp 2 --padding right[/]

[cyan]streambp-bench verify deepspeed -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero2[/]

[cyan]streambp-bench verify trainer sft -m ./my-model-dir --dtype float64 --set weight_decay=0.1[/]
"""


def _fmt(value: float | None) -> str:
    return "-" if value is None else f"{value:.2e}"


def render_table(report: VerifyReport) -> Table:
    """The report as a rich table: one row per method."""
    table = Table(title=f"gradients vs {report.reference} ({report.reference_dtype})", title_justify="left")
    table.add_column("method")
    for column in ("grad err", "grad tolerance"):
        table.add_column(column, justify="right")
    table.add_column("worst parameter", overflow="fold")
    for column in ("loss abs err", "loss tolerance"):
        table.add_column(column, justify="right")
    updates = any(result.max_update_err is not None for result in report.results)
    if updates:
        table.add_column("update err", justify="right")
    table.add_column("ok")
    for result in report.results:
        verdict = "[green]pass[/]" if result.ok else "[bold red]FAIL[/]"
        table.add_row(
            result.method,
            _fmt(result.max_rel_err),
            _fmt(result.tolerance),
            result.worst_param,
            _fmt(result.loss_abs_err),
            _fmt(result.loss_tolerance),
            *([_fmt(result.max_update_err)] if updates else []),
            verdict,
        )
    return table


def describe(report: VerifyReport) -> str:
    """One line saying how the numbers were obtained."""
    spec, step, stream = report.spec, report.spec.step, report.spec.step.stream
    head = f", streambp head {stream.head_mode}" if "streambp" in spec.methods else ""
    text = (
        f"{spec.source}: {step.model}, {step.dtype}, seq_len {step.seq_len_tokens}, batch {step.batch_size}, "
        f"ps {stream.partition_size}, ps-head {stream.head_partition_size}, padding {spec.padding}, "
        f"seed {step.seed}, objective {step.objective}, lora rank {step.lora_rank}, attn {stream.attn}, "
        f"optimizer {step.optimizer}, offload {stream.offload}{head}{_packing(spec)}; "
        f"reference loss {report.reference_loss:.6f}"
    )
    if report.reference_dtype != step.dtype:
        baseline = report.results[0].baseline_rel_err if report.results else None
        text += (
            f". Reference is plain in {report.reference_dtype} on the same {step.dtype}-rounded weights; "
            f"tolerance = 2 x plain-{step.dtype} error ({_fmt(baseline)}) + 1e-6"
        )
    return text


def _packing(spec) -> str:
    """The packed rows' documents, as the provenance line names them ('' when unpacked)."""
    if not spec.packing:
        return ""
    rows = "; ".join(",".join(map(str, row)) for row in spec.document_lengths())
    return f", packed documents {rows}"


def default_methods(offload: Tiers, optimizer: str) -> tuple[str, tuple[str, ...]]:
    """The methods `verify` checks when --method is not given, as a comma list, and the notes saying what
    was left out: checkpoint, mst and streambp, and plain with tiers it takes (the optimizer tier; without
    tiers plain is the reference itself). Where plain cannot take the tiers, a note names them and why."""
    if not offload:
        return ",".join(VERIFY_METHODS), ()
    if tier_problem("plain", offload, optimizer) is None:
        return ",".join(("plain", *VERIFY_METHODS)), ()
    refused = ",".join(tier for tier in offload.names if tier != "optimizer")
    why = "it keeps no checkpoints"
    if offload.params:
        why += " and cannot stream layers: autograd holds every layer's weights from forward to backward"
    return ",".join(VERIFY_METHODS), (
        f"note: plain is left out of the methods checked: offload {refused} does not apply to it ({why}); "
        f"it runs only as the reference, on the device without offload.",)


def print_report(report: VerifyReport, *, as_json: bool, refused: tuple[tuple[str, str], ...] = (),
                 notes: tuple[str, ...] = ()) -> None:
    """Table, provenance line and `notes`, then a line for each method left out (`refused`: (method, why),
    `without_refused`); or the JSON document, `refused` and `notes` under their keys; on stdout."""
    document = report.to_dict() | {"refused": [{"method": method, "reason": why} for method, why in refused],
                                   "notes": list(notes)}
    emit(document, as_json, lambda console: _print_tables(console, report, refused, notes))


def _print_tables(console, report: VerifyReport, refused: tuple[tuple[str, str], ...] = (),
                  notes: tuple[str, ...] = ()) -> None:
    console.print(render_table(report))
    console.print(describe(report), soft_wrap=True)
    for line in notes:
        console.print(escape(line), soft_wrap=True)
    verdict = (
        "[green]all methods match plain[/]" if report.ok else "[bold red]some methods do not match plain[/]"
    )
    console.print(verdict)
    for method, why in refused:
        console.print(escape(f"{method}: refused: {why}"), soft_wrap=True)


def without_refused(spec: VerifySpec, *, every_method: bool
                    ) -> tuple[VerifySpec, tuple[tuple[str, str], ...]]:
    """`spec` without the methods its model's family cannot run (`methods.guards.family_refusals`: mst,
    on a baselines family whose pieces it lacks) and (method, why) of each, when `every_method`
    (`--method all`, or no --method) and another method remains; else `spec` itself (a method named is
    refused by name when it runs)."""
    from streambp_core.methods.guards import family_refusals
    from streambp_core.models.load import load_config

    if not every_method:
        return spec, ()
    refusals = family_refusals(load_config(spec.step.model))
    kept = tuple(method for method in spec.methods if method not in refusals)
    if not kept or len(kept) == len(spec.methods):
        return spec, ()
    refused = tuple((method, refusals[method].removeprefix(f"{method}: ")) for method in spec.methods
                    if method in refusals)
    return replace(spec, methods=kept), refused


def verify_with_progress(spec) -> VerifyReport:
    """`verify_spec(spec)` under a rich progress line on stderr naming the stage that runs."""
    from streambp_core.verify.methods import verify_spec

    with Progress(SpinnerColumn(), BarColumn(bar_width=16), MofNCompleteColumn(),
                  TextColumn("{task.description}"), TimeElapsedColumn(),
                  console=stderr_console(), transient=True) as progress:
        task = progress.add_task(f"verify {escape(spec.step.model)}", total=None)

        def on_stage(stage: str, done: int, total: int) -> None:
            progress.update(task, completed=done, total=total,
                            description=escape(f"verify {spec.step.model}: {stage}"), refresh=True)

        return verify_spec(spec, on_stage)


def spec_from_options(*, model: str, method: str, seq_len: int, device: opt.Device = opt.Device.cpu,
                      nproc: int | None = None, packing: str | None = None, **options: object) -> VerifySpec:
    """The `VerifySpec` of a verify command's options (`options`: the step options it takes,
    `options.STEP_OPTIONS`); ConfigError, before torch, for a model that is not there, an unknown method, a
    step that cannot run, automatic partitions or --offload both (verify runs one step at the sizes
    given), --device sim, or fewer than 1 rank of `nproc` (whose model is loaded, so one that cannot run is
    refused before any rank starts)."""
    precheck_model(model)
    methods = method_list(method)
    if device.value == "sim":
        raise ConfigError("--device sim: verify compares real gradients; use --device cpu or cuda")
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    step = opt.step_fields(options, automatic=False, both=False)
    rows = {name: value for name, value in (("padding", step.pop("padding", None)), ("packing", packing))
            if value is not None}
    step["seq_len_tokens"] = seq_len
    StepSpec.of(model=model, method="streambp", **step)  # e.g. a fused head for dpo, before torch
    from streambp_core.measure.cuda import cuda_available
    from streambp_core.verify.methods import VerifySpec

    where = device.value
    if where == "auto":
        where = "cuda" if cuda_available() else "cpu"
    spec = VerifySpec.of(model=model, methods=methods, device=where, **rows, **step)
    if nproc is not None:
        from streambp_core.models.load import load_config

        load_config(model)
    return spec


@user_errors
@takes(*STEP, "padding", "device", "objective", "lora_rank", "attn", "head_mode", "optimizer", "offload",
       "packing")
def verify(*, ctx: typer.Context, **options) -> None:
    """The group's own check, when no subcommand is named (help text: `HELP`); with one, only that the
    options given belong to it (they go after its name)."""
    if ctx.invoked_subcommand is not None:
        _refuse_options_before(ctx)
        return
    as_json = options.pop("as_json")
    notes: tuple[str, ...] = ()
    every_method = _given(ctx, "method") is None or options["method"].strip() == "all"
    if _given(ctx, "method") is None:
        tiers = opt.step_fields({"offload": options["offload"]}, both=False)["offload"]
        options["method"], notes = default_methods(tiers, options["optimizer"].value)
    spec, refused = without_refused(spec_from_options(**options), every_method=every_method)
    report = verify_with_progress(spec)
    print_report(report, as_json=as_json, refused=refused, notes=notes)
    if not report.ok:
        raise typer.Exit(code=1)


def _given(ctx: typer.Context, name: str) -> str | None:
    """The flag of option `name` when the command line (or the environment) gave it, else None."""
    parameter = next(p for p in ctx.command.params if p.name == name)
    source = ctx.get_parameter_source(name)
    if source is None or source.name == "DEFAULT":  # typer may ship its own click: by name
        return None
    return parameter.opts[0]


def _refuse_options_before(ctx: typer.Context) -> None:
    """ConfigError when an option stands before the subcommand's name, where it would be this check's."""
    for parameter in ctx.command.params:
        flag = _given(ctx, parameter.name)
        if flag is not None:
            raise ConfigError(f"{flag} before {ctx.invoked_subcommand!r} is the single-process check's: give "
                              f"it after the subcommand, streambp-bench verify {ctx.invoked_subcommand} "
                              f"{flag} ...")
