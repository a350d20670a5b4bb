"""The GPU rows owed since the first H200 run, each next to the simulator's answer for the same step:

- checkpoint offload (`offload_rows`): streambp on the memory model with its checkpoints in pinned host
  memory and without, at one length: the allocator's peak, the pinned-host allocator's peak (column
  host_peak_gib) and the step time (column step_time_ms of the peak row), each with the simulated peak
  and host pool beside it;
- one FSDP2 rank on nccl (`fsdp_rows`): the step sharded by torch FSDP2 (ZeRO-3) on a one-rank nccl group
  (`parallel.launch.run_ranks`), its allocator peak next to the sharded simulation's;
- `max-len --device cuda` (`max_len_rows`): the measured search on a small model next to the simulated one;
- the host tiers (`tier_rows`): optimizer and parameter tiers (pinned host copies, a side stream) on CUDA:
  the device and pinned host peaks next to the simulated device and host pools.

A CUDA step here is measured without the live-tensor tracker (which costs seconds per layer chunk): the
caching allocator's peak (`torch.cuda.max_memory_allocated` after `reset_peak_memory_stats`), its
reserved peak, alloc retries and OOMs, and the pinned-host allocator's peak where this torch reports it
(`torch.cuda.host_memory_stats`); `measure.cuda.CudaPeak` reads them. On a CPU the same functions run
with wall-clock time and no allocator figures (the dry run replaces them by stand-ins: `selfcheck.plan`).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from dataclasses import dataclass

from streambp_bench.results import (
    ResultRow,
    allocator_columns,
    host_columns,
    memory_columns,
    provenance,
    spec_fields,
)
from streambp_core.config import StepSpec
from streambp_core.search import OK, OOM, ProbeResult

GIB_BYTES = 2**30


@dataclass(frozen=True)
class StepFigures:
    """One measured step: its probe (peak figures) and its time (ms)."""

    probe: ProbeResult
    step_ms: float | None


def measured_step(setup, device: str, *, warmup: int = 0) -> StepFigures:
    """`warmup` untimed steps, then one step of `setup` under the allocator's peak (CUDA) and timed (CUDA
    events on CUDA, the wall clock elsewhere); an out-of-memory step is an 'oom' probe. The gradients are
    freed afterwards."""
    from streambp_core.measure.cuda import is_oom
    from streambp_core.step.run.timing import spec_step

    spec = setup.spec
    try:
        with spec_step(setup) as step:
            for _ in range(warmup):
                step()
            probe, step_ms = _peak_of(step, device, spec.seq_len_tokens)
    except Exception as error:
        if not is_oom(error):
            raise
        if device == "cuda":  # the failed step's blocks back to the device for the next item
            import torch

            torch.cuda.empty_cache()
        probe = ProbeResult(seq_len_tokens=spec.seq_len_tokens, status=OOM, source=_source(device),
                            message=" ".join(str(error).split())[:300])
        step_ms = None
    finally:
        for param in setup.model.parameters():
            param.grad = None
    return StepFigures(probe, step_ms)


def _peak_of(step, device: str, seq_len: int) -> tuple[ProbeResult, float]:
    """One call of `step` measured: on CUDA the allocator's figures (`CudaPeak`) and CUDA-event time."""
    if device != "cuda":
        start = time.perf_counter()
        step()
        return ProbeResult(seq_len_tokens=seq_len, status=OK, source=_source(device)), \
            (time.perf_counter() - start) * 1e3
    import torch

    from streambp_core.measure.cuda import CudaPeak

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    with CudaPeak() as peak:
        start.record()
        step()
        end.record()
    end.synchronize()
    probe = ProbeResult(seq_len_tokens=seq_len, status=OK, source="measured-cuda",
                        peak_bytes=peak.peak_allocated_bytes, peak_reserved_bytes=peak.peak_reserved_bytes,
                        alloc_retries=peak.num_alloc_retries, num_ooms=peak.num_ooms,
                        host_peak_bytes=peak.peak_pinned_bytes)
    return probe, float(start.elapsed_time(end))


def _source(device: str) -> str:
    return f"measured-{device}"


def simulated_probe(spec: StepSpec, model) -> ProbeResult:
    """The simulator's peak and host pool for `spec` (meta tensors; `model` resolved or None)."""
    from streambp_core.step.simulation.simulate import simulate

    sim = simulate(spec, model)
    return ProbeResult(seq_len_tokens=spec.seq_len_tokens, status=OK, peak_bytes=sim.peak_bytes,
                       breakdown_bytes=sim.breakdown_bytes, source="simulated",
                       host_peak_bytes=sim.host_peak_bytes, to_host_bytes=sim.to_host_bytes,
                       to_device_bytes=sim.to_device_bytes)


def peak_row(spec: StepSpec, probe: ProbeResult, where: str, step_ms: float | None = None) -> ResultRow:
    """The peak_memory row of a probe (measured or simulated), with its host pool and allocator figures,
    and for a measured step its time."""
    peak = None if probe.peak_bytes is None else probe.peak_bytes / GIB_BYTES
    return ResultRow(**spec_fields(spec), status=probe.status, metric="peak_memory",
                     value=peak, error=probe.message if probe.status != OK else "",
                     **memory_columns(probe.peak_bytes, probe.breakdown_bytes), **allocator_columns(probe),
                     **host_columns(probe), step_time_ms=step_ms if probe.source != "simulated" else None,
                     **provenance(probe.source, where))


def offload_specs(model: str, dtype: str, seq_len: int) -> tuple[StepSpec, StepSpec]:
    """streambp at `seq_len` without and with checkpoint offload: layer partition T/3 (the timing runs'
    protocol), a 1024-token fused LM head."""
    base = StepSpec.of(model=model, method="streambp", seq_len_tokens=seq_len, dtype=dtype,
                       partition_size=-(-seq_len // 3), head_partition_size=1024, head_mode="auto")
    return base, base.replaced(offload="checkpoints")


def offload_rows(specs: tuple[StepSpec, ...], network, resolved_model, where: str, device: str,
                 warmup: int) -> Iterator[ResultRow]:
    """Each spec's measured peak with its step time (step_time_ms; the first spec's after `warmup` steps)
    and simulated peak; the ratio of their step times is the summary's (`report`)."""
    from streambp_core.step.run.setup import build_setup

    for index, spec in enumerate(specs):
        setup = build_setup(spec, resolved_model.config, device, model=network)
        figures = measured_step(setup, device, warmup=warmup if index == 0 else 0)
        yield peak_row(spec, figures.probe, where, figures.step_ms)
        yield peak_row(spec, simulated_probe(spec, resolved_model), where)


def fsdp_spec(model: str, dtype: str, seq_len: int) -> StepSpec:
    """streambp with AdamW on one FSDP2 rank (ZeRO-3), layer partition T/3, 1024-token fused head."""
    return StepSpec.of(model=model, method="streambp", seq_len_tokens=seq_len, dtype=dtype,
                       partition_size=-(-seq_len // 3), head_partition_size=1024, head_mode="auto",
                       optimizer="adamw", gpus=1, shard="zero3")


def fsdp_rank(rank: int, world: int, spec: StepSpec, config, device: str) -> tuple[ProbeResult, float | None]:
    """Body of the one rank (`run_ranks`): build, shard (FSDP2), one warm-up step, one measured step."""
    from functools import partial

    from streambp_core.parallel.fsdp import shard_model
    from streambp_core.step.run.setup import build_setup, build_training_model

    wrap = partial(shard_model, stage=spec.shard)
    network, optimizer = build_training_model(spec, config, device, wrap=wrap)
    setup = build_setup(spec, config, device, model=network, optimizer=optimizer)
    figures = measured_step(setup, device, warmup=1)
    return figures.probe, figures.step_ms


def fsdp_rows(spec: StepSpec, resolved_model, where: str, device: str) -> Iterator[ResultRow]:
    """One FSDP2 rank's measured peak and time (nccl on CUDA, gloo on a CPU) and the sharded simulation."""
    from streambp_core.parallel.launch import run_ranks

    probe, step_ms = run_ranks(fsdp_rank, 1, device=device, args=(spec, resolved_model.config, device))[0]
    yield peak_row(spec, probe, where, step_ms)
    yield peak_row(spec, simulated_probe(spec, resolved_model), where)


def max_len_rows(spec: StepSpec, budget_gib: float, where: str, device: str) -> Iterator[ResultRow]:
    """`max-len` on `device` (each probe a fresh process on CUDA) and on the simulator, one max_len row
    each (tokens; a capped answer is an error row saying so)."""
    from streambp_core.step.parts.resolved import ResolvedModel
    from streambp_core.step.search.probe import max_len

    resolved_model = ResolvedModel(spec.model)
    for target in (device, "sim"):
        result = max_len(spec, int(budget_gib * GIB_BYTES), target, resolved_model)
        source = "simulated" if target == "sim" else _source(device)
        fields = {**spec_fields(spec, seq_len_tokens=0), **provenance(source, where), "metric": "max_len",
                  "budget_gib": budget_gib}
        if result.capped:
            yield ResultRow(**fields, status="error", error=f"capped: fits the longest length searched, "
                                                           f"{result.max_len_tokens} tokens")
        else:
            yield ResultRow(**fields, value=float(result.max_len_tokens))


def tier_specs(model: str, dtype: str, seq_len: int) -> tuple[StepSpec, ...]:
    """streambp with AdamW, its optimizer state and then its parameters too in host tiers."""
    base = StepSpec.of(model=model, method="streambp", seq_len_tokens=seq_len, dtype=dtype, optimizer="adamw",
                       partition_size=-(-seq_len // 3), head_partition_size=1024, head_mode="auto")
    return tuple(base.replaced(offload=tiers) for tiers in ("optimizer", "optimizer,params"))


def tier_rows(specs: tuple[StepSpec, ...], resolved_model, where: str, device: str) -> Iterator[ResultRow]:
    """Each tier set's measured device and pinned host peaks (a fresh model: the tiers move its state) and
    the simulated device peak and host pool."""
    from streambp_core.step.run.setup import build_setup, build_training_model

    for spec in specs:
        network, optimizer = build_training_model(spec, resolved_model.config, device)
        setup = build_setup(spec, resolved_model.config, device, model=network, optimizer=optimizer)
        figures = measured_step(setup, device, warmup=1)
        del setup, network, optimizer
        yield peak_row(spec, figures.probe, where, figures.step_ms)
        yield peak_row(spec, simulated_probe(spec, resolved_model), where)
