"""`streambp-bench verify`: every method's gradients and loss against plain backprop, on one model."""

from __future__ import annotations

from enum import Enum
from typing import TYPE_CHECKING, Annotated

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
from streambp_bench.errors import user_errors
from streambp_bench.output import emit, stderr_console
from streambp_bench.specs import method_list
from streambp_bench.verify.deepspeed import sharded_stages
from streambp_core.config import VERIFY_METHODS, ConfigError, StreamConfig
from streambp_core.integrations.settings import PARITY_DATA_KINDS, TRAINER_KINDS
from streambp_core.models.config_file import precheck_model

if TYPE_CHECKING:
    from streambp_core.verify.methods import VerifyReport

HELP = (
    "Check that each method's loss and every parameter gradient equal plain backprop's.\n\n"
    "Builds the model with random weights, runs one step of [bold]plain[/] as the reference and one step "
    "of each method on the same random tokens, then compares every parameter's gradient: "
    "grad err = max over parameters of ||g - g_plain|| / (||g_plain|| + sqrt(numel) * rms), rms = RMS of "
    "plain's gradient over all parameters (a relative and an absolute part, as torch.testing.assert_close)."
    "\n\n"
    "Tolerance: 1e-10 in float64, 1e-4 in float32 (the loss too, relative to max(1, |loss|)); the table "
    "prints both the gradient and the loss tolerance beside the errors. In bfloat16 "
    "the reference is plain in float32 on the same bf16-rounded weights, and a method passes when its error "
    "is at most 2x plain bfloat16's. Progress goes to stderr. Exits 1 when a method fails, 2 on bad "
    "input.\n\n"
    "[bold]--offload checkpoints[/] runs each method with its checkpoints in host memory, through the real "
    "offload code path (on a CPU the host is the CPU: copies, no pinning); the check is the same, and "
    "offloading changes no bit of any gradient.\n\n"
    "[bold]--head-mode fused[/] checks streambp's fused LM head (each chunk's gradients taken in the "
    "forward pass; sft and grpo), [bold]auto[/] the head the objective allows (fused for sft and grpo); "
    "the default is the recomputing head.\n\n"
    "[bold]--nproc N[/] starts N ranks on this machine (gloo on CPU, nccl on CUDA: one GPU each), shards the "
    "model with torch FSDP2 (--shard zero2, zero3; both when not given) and compares every parameter's "
    "all-gathered gradient with single-process plain over the ranks' batches (each rank its own; the "
    "reference averages them), and counts each step's all-gathers and reduce-scatters (calls and bytes of "
    "the full tensors, per step and per FSDP unit: one per decoder layer plus the root). Full-parameter "
    "training in float64 or float32. [bold]--sp S[/] (with --nproc) runs sequence parallelism instead: "
    "groups of S ranks share each sequence (Ulysses), each computing its shard, and every method's "
    "gradients summed over the group are compared with single-process plain over the whole sequence, "
    "with each step's all-to-alls; with --shard zero2|zero3 the weights are sharded with FSDP2 over every "
    "rank too. [bold]--engine deepspeed[/] runs DeepSpeed ZeRO instead (--shard "
    "zero1, zero2, zero3; CPU ranks): the user's DeepSpeed loop for one optimizer step, the gradient ZeRO "
    "hands its optimizer against single-process plain's, the applied update against that optimizer's step "
    "on it, and how many times ZeRO reduced each parameter.\n\n"
    "[bold]--trainer trainer|sft|dpo|grpo[/] checks training instead of one gradient: builds the model as a "
    "user does (from_pretrained for a directory with weights, else from_config with random weights), "
    "trains it with transformers' Trainer or TRL's trainer plain and with stream_trainer for each method "
    "(3 optimizer steps of SGD unless --set says otherwise; random words over the model's vocabulary as "
    "data) and prints each parameter group's update error, ||update - update_plain|| / ||update_plain||. "
    "Tolerance: 1e-10 in float64 (1e-4 in float32) with SGD, 1e4 x that with Adam-like optimizers, whose "
    "normalisation amplifies the rounding of near-zero gradients. With [bold]--nproc N --engine "
    "fsdp2|deepspeed[/] the trainer runs on N CPU ranks under accelerate's FSDP2 or DeepSpeed plugin "
    "(gradient accumulation 2) and is compared with single-process plain and with plain on the engine."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench verify[/]    (Qwen/Qwen3-0.6B, float32, 128 tokens)

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --padding left -b 2[/]

[cyan]streambp-bench verify -m Qwen/Qwen3-8B --device cuda --dtype bfloat16[/]

[cyan]streambp-bench verify -m ./my-model-dir --method streambp --ps 64 --json[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --objective dpo -b 2 --lora-rank 8[/]

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --offload checkpoints[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --objective grpo -b 2 --head-mode fused[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --nproc 2 --shard zero3 --method all[/]

[cyan]streambp-bench verify -m tiny/llama --dtype float64 --nproc 2 --sp 2 --method all --padding right[/]

[cyan]streambp-bench verify -m ./my-model-dir --dtype float64 --trainer sft --set weight_decay=0.1[/]

[cyan]streambp-bench verify -m tiny/qwen3 --dtype float64 --trainer sft --nproc 2 --shard zero3[/]
[cyan]streambp-bench verify -m tiny/mistral --dtype float64 --packing 100,37,250 --seq-len 400 -b 2[/]
"""

DEFAULT_METHOD_LIST = ",".join(VERIFY_METHODS)
TrainerKind = Enum("TrainerKind", {kind: kind for kind in TRAINER_KINDS}, type=str)
TrainerData = Enum("TrainerData", {kind.replace("-", "_"): kind for kind in PARITY_DATA_KINDS}, type=str)


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
        f"offload {stream.offload}{head}{_packing(spec)}; "
        f"reference loss {report.reference_loss:.6f}"
    )
    if report.reference_dtype != step.dtype:
        baseline = report.results[0].baseline_rel_err if report.results else None
        text += (
            f". Reference is plain in {report.reference_dtype} on the same bf16-rounded weights; "
            f"tolerance = 2 x plain-{step.dtype} error ({_fmt(baseline)}) + 1e-6"
        )
    return text


def _packing(spec) -> str:
    """The packed rows' documents, as the provenance line names them ('' when unpacked)."""
    if not spec.packing:
        return ""
    rows = "; ".join(",".join(map(str, row)) for row in spec.document_lengths())
    return f", packed documents {rows}"


def print_report(report: VerifyReport, *, as_json: bool) -> None:
    """Table and provenance line, or the JSON document, on stdout."""
    emit(report.to_dict(), as_json, lambda console: _print_tables(console, report))


def _print_tables(console, report: VerifyReport) -> None:
    console.print(render_table(report))
    console.print(describe(report), soft_wrap=True)
    verdict = (
        "[green]all methods match plain[/]" if report.ok else "[bold red]some methods do not match plain[/]"
    )
    console.print(verdict)


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


@user_errors
def verify(
    model: opt.Model = "Qwen/Qwen3-0.6B",
    method: opt.Methods = DEFAULT_METHOD_LIST,
    seq_len: opt.SeqLen = 128,
    batch_size: opt.BatchSize = 1,
    ps: opt.PartitionSize = 48,
    ps_head: opt.HeadPartitionSize = 32,
    dtype: opt.DtypeOption = opt.Dtype.float32,
    padding: opt.PaddingOption = opt.Padding.none,
    seed: opt.Seed = 0,
    device: opt.DeviceOption = opt.Device.cpu,
    objective: opt.ObjectiveOption = opt.Objective.sft,
    lora_rank: opt.LoraRank = 0,
    attn: opt.AttnOption = opt.Attn.auto,
    head_mode: opt.HeadModeOption = opt.HeadMode.recompute,
    offload: opt.OffloadOption = opt.Tiers.NONE,
    nproc: Annotated[
        int | None, typer.Option("--nproc", help="Ranks to start (sharded verify); at most the CPU cores "
                                 "(cpu) or the GPUs (cuda).")
    ] = None,
    shard: Annotated[
        str | None, typer.Option("--shard", help="Stage of a sharded verify (needs --nproc): fsdp2: zero2 or "
                                 "zero3, both when not given; deepspeed: zero1, zero2 or zero3, all three "
                                 "when not given.")
    ] = None,
    trainer: Annotated[
        TrainerKind | None, typer.Option("--trainer", help="Check a trainer instead: its parameters after "
                                         "training with stream_trainer against plain training, per group.")
    ] = None,
    data: Annotated[
        TrainerData, typer.Option("--data", help="With --trainer: text or prompt-completion rows.")
    ] = TrainerData.text,
    settings: Annotated[
        list[str] | None, typer.Option("--set", help="With --trainer: a TrainingArguments / TRL config "
                                       "field, NAME=VALUE (repeat it), e.g. --set weight_decay=0.1.")
    ] = None,
    packing: Annotated[
        str, typer.Option("--packing", metavar="DOCS", help="Packed rows (sft): a document count (3: random "
                          "lengths filling each row) or lengths (100,37,250; a shorter total pads the row's "
                          "end); position_ids restart per document and attention stays within each.")
    ] = "",
    engine: Annotated[
        str, typer.Option("--engine", help="Sharding engine of a sharded verify (needs --nproc): fsdp2 "
                          "(torch FSDP2) or deepspeed (DeepSpeed ZeRO; the applied update of one step).")
    ] = "fsdp2",
    sp: Annotated[
        int | None, typer.Option("--sp", help="Sequence parallelism (needs --nproc): ranks sharing each "
                                 "sequence (Ulysses); every method's gradients, summed over them, against "
                                 "single-process plain over the whole sequence.")
    ] = None,
    as_json: opt.Json = False,
) -> None:
    """Verify every method against plain on one model (help text: `HELP`)."""
    precheck_model(model)
    if trainer is None and settings:
        raise ConfigError("--set applies to --trainer only: it sets a TrainingArguments / TRL config field")
    if trainer is not None:
        from streambp_bench.verify.trainer import parse_settings, run_trainer_parity

        if sp is not None or packing:
            raise ConfigError(f"{'--sp' if sp is not None else '--packing'} does not apply to --trainer: the "
                              "trainer check trains whole, unpacked rows on one rank or data-parallel ranks")
        parse_settings(settings)  # bad values refused before anything trains

        unused = {"--padding": padding.value != "none", "--objective": objective.value != "sft",
                  "--head-mode": head_mode.value != "recompute", "--offload": bool(offload)}
        if not run_trainer_parity(
                trainer.value, model=model, methods=method_list(method), dtype=dtype.value, seq_len=seq_len,
                batch_size=batch_size, ps=ps, ps_head=ps_head, seed=seed, device=device.value,
                lora_rank=lora_rank, attn=attn.value, data=data.value, settings=settings, unused=unused,
                as_json=as_json, nproc=nproc, shard=shard, engine=engine):
            raise typer.Exit(code=1)
        return
    methods = method_list(method)
    where = device.value
    if where == "sim":
        raise ConfigError("--device sim: verify compares real gradients; use --device cpu or cuda")
    if sp is not None:
        from streambp_bench.verify.sequence import check_sequence_options

        check_sequence_options(sp, nproc, engine, shard)
    if shard is not None and nproc is None:
        raise ConfigError("--shard needs --nproc N: the ranks to shard the model across")
    stages = sharded_stages(engine, shard, nproc)
    if nproc is not None and sp is None and offload:
        raise ConfigError("--offload with --nproc: the sharded verify runs without offload")
    head = StreamConfig(objective=objective.value, head_mode=head_mode.value).head_mode  # before torch
    if nproc is not None and sp is None and "streambp" in methods and head != "recompute":
        raise ConfigError(f"--head-mode {head_mode.value} with --nproc: the sharded verify runs streambp's "
                          "recomputing head (--head-mode recompute)")
    if nproc is not None and packing:
        raise ConfigError("--packing with --nproc: the sharded verify runs unpacked rows")
    if nproc is not None and nproc < 1:
        raise ConfigError(f"--nproc must be at least 1, got {nproc}")
    from streambp_core.measure.cuda import cuda_available
    from streambp_core.verify.methods import VerifySpec

    if where == "auto":
        where = "cuda" if cuda_available() else "cpu"

    spec = VerifySpec.of(
        model=model, methods=methods, padding=padding.value, device=where, seq_len_tokens=seq_len,
        batch_size=batch_size, partition_size=ps, head_partition_size=ps_head, dtype=dtype.value, seed=seed,
        objective=objective.value, lora_rank=lora_rank, attn=attn.value, head_mode=head_mode.value,
        offload=offload,
        packing=packing,
    )
    if nproc is not None:
        from streambp_core.models.load import load_config

        load_config(model)  # a model that cannot run is refused before any rank starts
    if sp is not None:
        from streambp_bench.verify.sequence import run_sequence

        ok = run_sequence(spec, nproc, sp, shard, as_json=as_json)
    elif nproc is not None and engine == "deepspeed":
        from streambp_bench.verify.deepspeed import run_deepspeed

        ok = run_deepspeed(spec, nproc, stages, as_json=as_json)
    elif nproc is not None:
        from streambp_bench.verify.sharded import run_sharded

        ok = run_sharded(spec, nproc, stages, as_json=as_json)
    else:
        report = verify_with_progress(spec)
        print_report(report, as_json=as_json)
        ok = report.ok
    if not ok:
        raise typer.Exit(code=1)
