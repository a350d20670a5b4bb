"""The GPU self-check's original steps: bf16 exactness, measured vs simulated peak memory, step time,
a kernel profile and the kernel workspace, as result rows (the plan that runs them with the owed rows
is `selfcheck.items`).

1. verify in bfloat16 on the verify model for every objective and attention kernel (flash-attn only when
   importable; streambp with the fused LM head for sft and grpo): a method passes when its gradient
   error against an fp32 plain reference is at most 2x plain bf16's error against the same reference.
2. memory: the measured peak of one step of every method at three lengths on the memory model, next to
   the simulator's prediction for the same settings (`measured_peak`: on CUDA the caching allocator's
   peak over an untracked step, with the reserved peak, alloc retries and OOM count; on a CPU the
   live-tensor tracker's).
3. time: median step time of checkpoint and streambp at the plan's timed lengths (CUDA events; warm-up
   first), with the layer partition T/3 of the paper's timing runs (Table 1), streambp at each of the
   plan's timed LM-head partitions (the paper's 100, and a wider one: a 100-token head chunk re-reads
   the vocab x hidden weight and its gradient once per 100 tokens), and streambp with both partitions
   chosen automatically (the largest whose simulated peak fits the device, found once per length); on
   CUDA with the allocator's retries and OOM count over the timed steps.
4. profile: at the longest timed length, one profiled step of each timed variant, kernel time by class
   (attention forward/backward, GEMM, copy, other; metric `kernel_ms_<class>`): where the time goes.
5. kernel workspace: streambp on the memory model at the plan's workspace lengths, for each attention
   kernel, with its attention backward blocked over keys and without (metrics peak_memory_blocked and
   peak_memory_unblocked): the measured peak next to the simulator's, which counts the kernels' own
   buffers (`streambp_core.engine.attention.workspace`); a simulated row off the allocator's peak by more
   than 3% is an error. attn sdpa runs torch's FlashAttention-2 on the chunks that attend to a prefix and
   cuDNN on each layer's first, square chunk (SDPA's dispatch on Hopper); flash runs flash-attn.
Without CUDA the same code runs on CPU with a tiny preset and tiny lengths.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import cache

import torch

from streambp_bench.results import (
    ResultRow,
    allocator_columns,
    memory_columns,
    provenance,
    row_head_mode,
    spec_fields,
)
from streambp_bench.selfcheck.families import FAMILY_MODELS
from streambp_bench.selfcheck.gradients import grad_rows
from streambp_bench.selfcheck.owed import measured_step
from streambp_core.config import AUTO, METHODS, StepSpec
from streambp_core.measure.cuda import cuda_available, device_info
from streambp_core.measure.kernels import profile_kernel_time
from streambp_core.measure.units import GIB
from streambp_core.models.load import build_model
from streambp_core.search import OK, ProbeResult
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.run.setup import build_setup
from streambp_core.step.run.timing import spec_step, timed_step
from streambp_core.step.search.partitions import fitting_partitions
from streambp_core.step.search.probe import measure_setup
from streambp_core.step.simulation.simulate import simulate
from streambp_core.verify.methods import VerifySpec

WORKSPACE_TOLERANCE = 0.03
"""Largest relative gap between a simulated and a measured peak of the kernel-workspace rows."""


@dataclass(frozen=True, kw_only=True)
class CheckPlan:
    """Models, lengths and precisions of one self-check."""

    device: str
    verify_model: str
    verify_dtype: str
    verify_seq_len: int
    memory_model: str
    dtype: str
    lengths: tuple[int, ...]
    objectives: tuple[str, ...] = ("sft", "grpo", "dpo")
    partition_size: int = 500
    head_partition_size: int = 100
    timed_head_partitions: tuple[int | str, ...] = (100, 1024, AUTO)
    """LM-head partitions of the streambp step-time and profile rows; AUTO: both partitions chosen by
    `auto_partitions` (the largest whose simulated peak fits the device's memory)."""
    time_lengths: tuple[int, ...] = ()
    """Lengths of the step-time rows (the profile runs the longest); none: `lengths`."""
    budget_gib: float | None = None
    """Memory the AUTO partitions may fill; None: the CUDA device's total memory."""
    workspace_lengths: tuple[int, ...] = ()
    """Lengths of the kernel-workspace rows (step 5); none: no such rows."""
    offload_lengths: tuple[int, ...] = ()
    """Lengths of the checkpoint-offload rows (streambp on the memory model, with and without)."""
    fsdp_length: int = 16384
    """Length of the one-rank FSDP2 step (nccl on CUDA)."""
    small_model: str = "Qwen/Qwen3-0.6B"
    """The model of the `max-len --device cuda` search and of the host-tier steps."""
    max_len_budget_gib: float = 6.0
    max_len_partition_size: int = 4096
    """The search's layer partition (few chunks: each measured probe runs the live-tensor tracker)."""
    tier_length: int = 4096
    """Length of the host-tier steps (optimizer, then optimizer and parameters in pinned host memory)."""
    family_models: tuple[str, ...] = ()
    """Tiny presets whose every method is verified as the plan's model is (`families.family_rows`)."""
    family_seq_len: int = 256

    @property
    def timed_lengths(self) -> tuple[int, ...]:
        return self.time_lengths or self.lengths


GPU_PLAN = CheckPlan(device="cuda", verify_model="Qwen/Qwen3-0.6B", verify_dtype="bfloat16",
                     verify_seq_len=1024, memory_model="Qwen/Qwen3-1.7B", dtype="bfloat16",
                     lengths=(4096, 8192, 16384), time_lengths=(16384,),
                     workspace_lengths=(65536, 131072), offload_lengths=(65536, 262144),
                     max_len_partition_size=8192, family_models=FAMILY_MODELS)
CPU_PLAN = CheckPlan(device="cpu", verify_model="tiny/qwen3", verify_dtype="float32", verify_seq_len=32,
                     memory_model="tiny/qwen3", dtype="float32", lengths=(48, 96, 144),
                     partition_size=32, head_partition_size=16, timed_head_partitions=(16, AUTO),
                     budget_gib=1.0, workspace_lengths=(96, 144),
                     family_models=("tiny/gpt-oss", "tiny/qwen3.5"), family_seq_len=48)


def default_plan() -> CheckPlan:
    """The GPU plan when CUDA is present, else the CPU dry run."""
    return GPU_PLAN if cuda_available() else CPU_PLAN


def device_name(plan: CheckPlan) -> str:
    """The GPU's name (NVML when installed), or 'cpu'."""
    return device_info().name if plan.device == "cuda" else "cpu"


def attention_kernels(plan: CheckPlan) -> tuple[str, ...]:
    """Kernels to check: sdpa always; flash when flash-attn is importable on CUDA."""
    from streambp_core.engine.attention.prefix import flash_attn_available

    return ("flash", "sdpa") if plan.device == "cuda" and flash_attn_available() else ("sdpa",)


def verify_rows(plan: CheckPlan, where: str) -> Iterator[ResultRow]:
    """Step 1: one row per (objective, kernel, method), metric grad_rel_err."""
    for objective in plan.objectives:
        for attn in attention_kernels(plan):
            spec = VerifySpec.of(model=plan.verify_model, seq_len_tokens=plan.verify_seq_len, batch_size=2,
                                 dtype=plan.verify_dtype, padding="right", device=plan.device,
                                 objective=objective, attn=attn, partition_size=256, head_partition_size=100,
                                 head_mode="auto")  # the fused head where the objective allows it (sft, grpo)
            yield from grad_rows(spec, where)


def memory_spec(plan: CheckPlan, method: str, seq_len: int) -> StepSpec:
    """The step of a memory row: the memory model, the plan's precision and partitions."""
    return StepSpec.of(model=plan.memory_model, method=method, seq_len_tokens=seq_len, dtype=plan.dtype,
                       partition_size=plan.partition_size, head_partition_size=plan.head_partition_size)


def memory_rows(plan: CheckPlan, model, where: str) -> Iterator[ResultRow]:
    """Step 2: measured and simulated peak of every method at every length (metric peak_memory)."""
    resolved = ResolvedModel(model.config)
    for method in METHODS:
        for seq_len in plan.lengths:
            spec = memory_spec(plan, method, seq_len)
            measured = measured_peak(plan, build_setup(spec, model.config, plan.device, model=model))
            yield _memory_row(spec, measured, where)
            yield _memory_row(spec, _simulated(spec, resolved), where)


def measured_peak(plan: CheckPlan, setup) -> ProbeResult:
    """One step's measured peak: on CUDA the caching allocator's, over an untracked step
    (`owed.measured_step`: the live-tensor tracker costs seconds per layer chunk, the allocator nothing);
    elsewhere the tracker's (`measure_setup`), the only peak a CPU step has."""
    if plan.device == "cuda":
        return measured_step(setup, plan.device).probe
    return measure_setup(setup, plan.device)


def _simulated(spec: StepSpec, resolved: ResolvedModel) -> ProbeResult:
    """The simulator's prediction for `spec`, as a probe result."""
    sim = simulate(spec, resolved)
    return ProbeResult(seq_len_tokens=spec.seq_len_tokens, status=OK, peak_bytes=sim.peak_bytes,
                       breakdown_bytes=sim.breakdown_bytes, source="simulated")


def workspace_rows(plan: CheckPlan, model, where: str) -> Iterator[ResultRow]:
    """Step 5: streambp's measured and simulated peak per attention kernel, blocked or not, per length."""
    config = model.config
    for attn in attention_kernels(plan):
        for blocking in (False, True):
            metric = "peak_memory_blocked" if blocking else "peak_memory_unblocked"
            for seq_len in plan.workspace_lengths:
                spec = memory_spec(plan, "streambp", seq_len).replaced(attn=attn, attn_blocking=blocking)
                measured = measured_peak(plan, build_setup(spec, config, plan.device, model=model))
                yield _memory_row(spec, measured, where, metric)
                yield _judged(_memory_row(spec, _simulated(spec, config), where, metric), measured)


def _judged(simulated: ResultRow, measured: ProbeResult) -> ResultRow:
    """The simulated row, an error when it is off the allocator's peak by more than WORKSPACE_TOLERANCE (a
    CPU dry run's tracker peak is not judged: the target is about the GPU)."""
    if measured.source != "measured-cuda" or measured.peak_bytes is None or simulated.value is None:
        return simulated
    ratio = simulated.value * GIB / measured.peak_bytes
    if abs(ratio - 1) <= WORKSPACE_TOLERANCE:
        return simulated
    return replace(simulated, status="error",
                   error=f"simulated/measured {ratio:.3f}: outside {WORKSPACE_TOLERANCE:.0%}")


def _memory_row(spec: StepSpec, probe: ProbeResult, where: str, metric: str = "peak_memory") -> ResultRow:
    """A peak row (`metric`) of one probe (measured or simulated), with the allocator's figures it has."""
    peak = None if probe.peak_bytes is None else probe.peak_bytes / GIB
    return ResultRow(
        **spec_fields(spec), status=probe.status, metric=metric, value=peak, error=probe.message,
        **memory_columns(probe.peak_bytes, probe.breakdown_bytes), **allocator_columns(probe),
        **provenance(probe.source, where),
    )


def timed_variants(plan: CheckPlan) -> list[tuple[str, int | str]]:
    """(method, LM-head partition) pairs of the time and profile steps: checkpoint (its head is whole;
    the plan's partition is only recorded), then streambp at each timed head partition (or AUTO)."""
    return [("checkpoint", plan.head_partition_size)] + [("streambp", p) for p in plan.timed_head_partitions]


def _partitions(plan: CheckPlan, seq_len: int, head_partition: int | str) -> tuple[int, int]:
    """(layer partition, head partition) of a timed variant: T/3 and the given head partition, or for
    AUTO the largest pair whose simulated peak (the fused head the timed step runs, its vocab x hidden
    gradient buffer included) fits the plan's budget."""
    if head_partition != AUTO:
        return -(-seq_len // 3), head_partition
    budget = (plan.budget_gib * GIB if plan.budget_gib is not None
              else torch.cuda.get_device_properties(plan.device).total_memory)
    return _auto_partitions(plan, seq_len, int(budget))


@cache
def _auto_partitions(plan: CheckPlan, seq_len: int, budget_bytes: int) -> tuple[int, int]:
    """The AUTO partitions of a length (`fitting_partitions`: a search of simulations), found once for the
    time and the profile rows."""
    spec = StepSpec.of(model=plan.memory_model, method="streambp", seq_len_tokens=seq_len, dtype=plan.dtype,
                       head_mode="auto")
    chosen = fitting_partitions(spec, budget_bytes)  # the model resolved there
    return chosen.stream.partition_size, chosen.stream.head_partition_size


def timed_head_mode(plan: CheckPlan, method: str) -> str:
    """The head_mode cell of a timed variant's rows: the head its sft step runs (streambp: auto, fused)."""
    return row_head_mode(StepSpec.of(model=plan.memory_model, method=method, head_mode="auto"))


def timed_spec(plan: CheckPlan, method: str, seq_len: int, head_partition: int | str) -> StepSpec:
    """The sft step of one timed variant: the plan's memory model and precision, the variant's partitions
    (`_partitions`), streambp with the head the objective allows (auto: fused)."""
    partition, head = _partitions(plan, seq_len, head_partition)
    return StepSpec.of(model=plan.memory_model, method=method, seq_len_tokens=seq_len, dtype=plan.dtype,
                       partition_size=partition, head_partition_size=head, head_mode="auto")


def _timed_row_fields(plan: CheckPlan, spec: StepSpec, where: str) -> dict:
    """The fields every row of a timed variant has: its step (partitions recorded even for checkpoint,
    whose head is whole) and provenance."""
    return dict(method=spec.method, model=plan.memory_model, seq_len_tokens=spec.seq_len_tokens,
                batch_size=1, partition_size=spec.stream.partition_size,
                head_partition_size=spec.stream.head_partition_size,
                head_mode=timed_head_mode(plan, spec.method), dtype=plan.dtype,
                **provenance(f"measured-{plan.device}", where))


def time_rows(plan: CheckPlan, model, where: str, repeats: int = 3) -> Iterator[ResultRow]:
    """Step 3: step time of each timed variant (metric step_time, ms: p50, with p20/p80)."""
    for seq_len in plan.timed_lengths:
        for method, head_partition in timed_variants(plan):
            spec = timed_spec(plan, method, seq_len, head_partition)
            setup = build_setup(spec, model.config, plan.device, model=model)
            timing = timed_step(setup, plan.device, warmup=1, repeats=repeats)
            model.zero_grad(set_to_none=True)
            yield ResultRow(**_timed_row_fields(plan, spec, where), metric="step_time", value=timing.p50_ms,
                            **timing.columns())


def profile_rows(plan: CheckPlan, model, where: str) -> Iterator[ResultRow]:
    """Step 4: kernel time by class of one profiled step per timed variant at the longest length."""
    seq_len = max(plan.timed_lengths)
    for method, head_partition in timed_variants(plan):
        spec = timed_spec(plan, method, seq_len, head_partition)
        common = _timed_row_fields(plan, spec, where)
        with spec_step(build_setup(spec, model.config, plan.device, model=model)) as step:
            step()  # warm-up: the profile sees a steady-state step
            message = "the profiler recorded no kernels"
            try:
                classes = profile_kernel_time(step, plan.device)
            except RuntimeError as error:  # e.g. a profiler that cannot start must not sink the check
                classes, message = [], str(error).split("\n")[0]
        model.zero_grad(set_to_none=True)
        if not classes:
            yield ResultRow(metric="kernel_ms_total", status="error", error=message, **common)
        for item in classes:
            yield ResultRow(metric=f"kernel_ms_{item.kernel_class}", value=item.self_time_ms, **common)


def memory_model(plan: CheckPlan):
    """The memory/time model on the check's device, random weights, in the check's dtype."""
    dtype = {"bfloat16": torch.bfloat16, "float32": torch.float32}[plan.dtype]
    return build_model(plan.memory_model, dtype=dtype, device=plan.device, seed=0)
