"""`streambp-bench verify deepspeed --nproc N`: DeepSpeed ZeRO across N CPU ranks, as a table.

The work is `streambp_core.verify.deepspeed.verify_deepspeed`; this module checks the engine,
its version, the stages and the ranks before any process starts, and prints each (stage, method)'s
reduced gradient against single-process plain's, its applied update against the engine's own
optimizer on that gradient, and how many times ZeRO reduced each parameter.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from rich.table import Table

from streambp_bench.output import emit
from streambp_core.config import FSDP_STAGES, ConfigError

if TYPE_CHECKING:
    from streambp_core.verify.methods import VerifySpec

ENGINES = ("fsdp2", "deepspeed")
DEEPSPEED_DEFAULT = ("zero1", "zero2", "zero3")


def sharded_stages(engine: str, shard: str | None) -> tuple[str, ...]:
    """The stages a sharded check runs on `engine`: `shard`, else every stage of the engine; ConfigError
    for a stage the engine has not, or a missing or too old DeepSpeed (before any rank starts)."""
    if engine not in ENGINES:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINES)}, got {engine!r}")
    if engine == "fsdp2":
        if shard is not None and shard not in FSDP_STAGES:
            raise ConfigError(f"--shard for fsdp2 must be one of {', '.join(FSDP_STAGES)}, got {shard!r}")
        return (shard,) if shard else FSDP_STAGES
    from streambp_core.parallel.deepspeed import check_installed, check_stage

    check_installed()
    if shard is not None:
        check_stage(shard)
    return (shard,) if shard else DEEPSPEED_DEFAULT


def run_deepspeed(spec: VerifySpec, nproc: int, stages: tuple[str, ...], *, as_json: bool,
                  optimizer: str = "adam") -> bool:
    """Verify `spec` on DeepSpeed ZeRO across `nproc` CPU ranks for every stage with `optimizer` (adam,
    sgd); print; whether all passed."""
    from streambp_bench.verify.sharded import on_ranks
    from streambp_core.parallel.launch import check_nproc
    from streambp_core.verify.deepspeed import check_spec, report, verify_deepspeed

    check_nproc(nproc, spec.device)
    check_spec(spec, stages)
    results = on_ranks(f"verifying on {nproc} deepspeed ranks (gloo): {', '.join(stages)} ...",
                       lambda: verify_deepspeed((spec,), nproc=nproc, shards=stages, optimizer=optimizer))
    summary = report(results)
    emit(summary, as_json, lambda console: _print(console, results, spec, nproc))
    return summary["ok"]


def _print(console, results, spec: VerifySpec, nproc: int) -> None:
    table = Table(title=f"one optimizer step on {nproc} ranks: the reduced gradient vs single-process "
                        "plain's, the applied update vs the engine's optimizer on it", title_justify="left")
    sgd = results[0].optimizer == "sgd"
    update = "update vs plain's SGD (/ float32 allowance)" if sgd else "update vs plain's Adam (reported)"
    for column in ("shard", "method", "grad err", "step err", update, "reductions per parameter", "ok"):
        table.add_column(column)
    for r in results:
        counts = ", ".join(f"{n} param(s) x{times}" for times, n in sorted(r.reductions.items()))
        against = f"{r.update_err:.2e}" + (f" ({r.update_ratio:.2f})" if r.update_ratio is not None else "")
        table.add_row(r.shard, r.method, f"{r.grad_err:.2e}", f"{r.step_err:.2e}", against,
                      counts, "[green]pass[/]" if r.ok else "[bold red]FAIL[/]")
    console.print(table)
    step, stream = spec.step, spec.step.stream
    first = results[0]
    optimizer = "a client torch SGD" if sgd else "torch's Adam"
    update_note = (
        "the update against plain's SGD step is judged against float32's rounding of the write (twice "
        "plain's own float32 step's distance from the exact step, plus the gradient's bound): the ratio in "
        "brackets, at most 1. " if sgd else
        "the update against plain's gradient stepped by Adam is reported only (Adam's first step divides "
        "each element by its own size, so elements near eps move on float32 rounding). ")
    console.print(f"measured-cpu: {step.model}, {step.dtype}, {nproc} gloo ranks, DeepSpeed ZeRO with "
                  f"{optimizer}, seq_len {step.seq_len_tokens} and batch {step.batch_size} per rank, ps "
                  f"{stream.partition_size}, ps-head {stream.head_partition_size}, objective "
                  f"{step.objective}, seed {step.seed}. grad err: the float32 gradient ZeRO hands its "
                  f"optimizer (DeepSpeed's safe_get_full_grad) against single-process plain's, bound "
                  f"{first.grad_tolerance:.0e}; step err: the applied update against the engine's own "
                  f"optimizer stepping that gradient from its masters, bound {first.step_tolerance:.0e}; "
                  f"{update_note}Reductions counted as ZeRO buckets each gradient, per micro-step (zero2, "
                  "zero3) or per step (zero1).",
                  soft_wrap=True)
