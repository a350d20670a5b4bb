"""One rank's memory under DeepSpeed ZeRO, measured: the step run for real on CPU ranks (gloo) under the
memory tracker, the counterpart of the `deepspeed-zero2`/`deepspeed-zero3` layouts (`step.parts.shards`).

`measure_deepspeed_ranks(specs, config)` starts `gpus` ranks (`launch.run_ranks`). For each spec, each
rank builds the spec's model in bf16 with seeded weights, hands it to `deepspeed.initialize` (ZeRO stage
2 or 3, bf16, torch's AdamW on the fp32 partitions, DeepSpeed's default buckets: what the layouts
assume), prepares the engine for the spec's method and runs one untracked step (DeepSpeed allocates its
gradient partition, fp32 gradient and AdamW's moments on the first) and then one step under the tracker
(`count_existing`: every storage made before, DeepSpeed's flat buffers included, counts from the first
op that reads it), cutting phases at the loss, after `engine.backward` and after `engine.step`. Ranks run
the same sequence; rank 0's figures come back.

With DeepSpeed's offload (`deepspeed-zero3`, the spec's optimizer or params tier: `offload_optimizer` /
`offload_param` on the CPU, `deepspeed.offload_sections`; `measure_deepspeed_pools`), the optimizer is
DeepSpeed's CPU Adam (`DeepSpeedCPUAdam`, compiled on first use, as a user of `offload_optimizer` runs
it), the run is prepared with the spec's tiers (the engine's sections hold them,
`engine.engines.deepspeed_tiers`), and the tracker files what DeepSpeed keeps as offloaded state in its host
pool from the start: the parameters' partitions (`param_groups_fp16_flat_cpu_memory`), the fp32 master
partitions and their fp32 gradients, CPU Adam's moments and the gradient partition
(`grad_partitions_flat_buffer`), and whatever the CPU Adam step allocates. On CPU ranks both pools are
host memory, so the split is DeepSpeed's own bookkeeping (those buffers against everything else:
gathered parameters, the reduce bucket, gradients in flight, activations), not two memories. Copies
into the host pool are what a GPU rank copies out (each gradient partition, and its fp32 cast). Copies
out of it are not: a gather reads its host partition in place on the CPU (`.to("cpu")` copies nothing),
while ops that read a host buffer into a new tensor (the fp32 cast of the gradient buffer, DeepSpeed's
gradient norms), which on a GPU read device copies, count as copies here.

Not seen by the tracker: what gloo allocates inside a collective, and a storage that exists but that no
op reads during the step (DeepSpeed's fp32 partitions are read by the step; the bf16 weights by the
forward): under such a storage's weight the measured peak is low, never high.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec
from streambp_core.parallel.deepspeed import offload_sections
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, check_nproc, run_ranks
from streambp_core.parallel.memory import RankMemory
from streambp_core.tiers import Tiers

STAGES = {"deepspeed-zero2": 2, "deepspeed-zero3": 3}
"""The layouts measured, by ZeRO stage."""


@dataclass(frozen=True, kw_only=True)
class HostPool:
    """What the tracker filed as DeepSpeed's offloaded state over a measured step (module docstring)."""

    peak_bytes: int
    to_host_bytes: int
    to_device_bytes: int


def deepspeed_config(stage: int, offload: Tiers = Tiers.NONE) -> dict:
    """DeepSpeed's config for a measured rank: bf16, ZeRO `stage` with its default buckets, AdamW (fp32
    master weights and moments), no clipping; with the optimizer or params tier DeepSpeed's offload
    sections for them (`deepspeed.offload_sections`) and its CPU Adam, else torch's AdamW."""
    sections = offload_sections(offload, stage)
    adamw = {"lr": 1e-5} if "offload_optimizer" in sections else {"lr": 1e-5, "torch_adam": True}
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": adamw},
            "zero_optimization": {"stage": stage, **sections}, "gradient_clipping": 0.0,
            "steps_per_print": 1 << 30}


def measure_deepspeed_ranks(specs: Sequence[StepSpec], config: PretrainedConfig, *,
                            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RankMemory]:
    """Rank 0's tracked step of each spec (module docstring); the specs share a model and rank count,
    bf16, AdamW, a DeepSpeed layout. ConfigError for anything else or more ranks than cores."""
    return [rank for rank, _ in measure_deepspeed_pools(specs, config, timeout_s=timeout_s)]


def measure_deepspeed_pools(specs: Sequence[StepSpec], config: PretrainedConfig, *,
                            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[tuple[RankMemory, HostPool]]:
    """`measure_deepspeed_ranks` with each step's host pool: DeepSpeed's offloaded state (module
    docstring; empty without offload)."""
    if not specs:
        raise ConfigError("give at least one spec")
    if len({(spec.model, spec.gpus) for spec in specs}) != 1:
        raise ConfigError("measured ranks run one model on one rank count; the specs differ")
    for spec in specs:
        if spec.shard not in STAGES or spec.dtype != "bfloat16" or spec.optimizer != "adamw":
            raise ConfigError(f"a DeepSpeed rank is measured as the layouts assume it ({', '.join(STAGES)}, "
                              f"bfloat16, adamw), got {spec.shard}, {spec.dtype}, {spec.optimizer}")
        offload_sections(spec.offload, STAGES[spec.shard])
    check_nproc(specs[0].gpus, "cpu")
    steps = run_ranks(_rank_steps, specs[0].gpus, args=(tuple(specs), config), timeout_s=timeout_s)[0]
    out = []
    for spec, phases in zip(specs, steps, strict=True):
        _, peak, breakdown, _ = max(phases, key=lambda phase: phase[1])
        rank = RankMemory(spec=spec, peak_bytes=peak, breakdown_bytes=breakdown,
                          phase_peaks_bytes={phase[0]: phase[1] for phase in phases})
        host = phases[-1][3]
        out.append((rank, HostPool(peak_bytes=max(phase[3][0] for phase in phases), to_host_bytes=host[1],
                                   to_device_bytes=host[2])))
    return out


def _rank_steps(rank: int, world: int, specs: tuple[StepSpec, ...], config: PretrainedConfig):
    """Body of each rank: per spec, a fresh engine, one untracked step and one tracked step; per phase
    (name, peak, breakdown, (host peak, bytes to host, bytes to device))."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return [_tracked_engine_step(spec, config) for spec in specs]


def _tracked_engine_step(spec: StepSpec, config: PretrainedConfig) -> list[tuple]:
    import deepspeed

    import streambp_core
    from streambp_core.measure.tracker import MemoryTracker
    from streambp_core.models import build_model
    from streambp_core.step.run.setup import step_inputs

    model = build_model(config, dtype=torch.bfloat16, device="cpu", seed=spec.seed, checked=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(STAGES[spec.shard], spec.offload))
    inputs = step_inputs(spec, config.vocab_size, "cpu")
    offloaded = bool(offload_sections(spec.offload, STAGES[spec.shard]))
    inner = engine.optimizer.optimizer
    phases = []
    with streambp_core.prepare(engine, spec.method, spec.stream) as run:  # its tiers: DeepSpeed's sections
        engine.backward(run.loss(**inputs))
        engine.step()
        with MemoryTracker(engine.module, None if offloaded else inner, device="cpu",
                           count_existing=True) as tracker:
            hooks = _file_offloaded(tracker, engine.optimizer) if offloaded else []
            loss = run.loss(**inputs)
            phases.append(_cut(tracker, "forward"))
            engine.backward(loss)
            del loss
            phases.append(_cut(tracker, "backward"))
            engine.step()
            phases.append(_cut(tracker, "optimizer"))
            for hook in hooks:
                hook.remove()
    return phases


def _file_offloaded(tracker, zero) -> list:
    """File DeepSpeed's offloaded state (module docstring) in the tracker's host pool, and what its CPU
    optimizer's step allocates; the step hooks' handles."""
    from streambp_core.measure.tags import OFFLOADED, memory_category

    tensors = list(zero.param_groups_fp16_flat_cpu_memory) if zero.offload_param else []
    if zero.offload_optimizer:
        masters = list(zero.fp32_partitioned_groups_flat)
        tensors += [*masters, *(m.grad for m in masters if m.grad is not None),
                    *(t for state in zero.optimizer.state.values() for t in state.values()
                      if isinstance(t, torch.Tensor) and t.dim()),
                    zero.grad_partitions_flat_buffer]
    tracker.track(tensors, OFFLOADED)
    category = memory_category(OFFLOADED)

    def enter(*_) -> None:
        category.__enter__()

    def leave(*_) -> None:
        category.__exit__(None, None, None)

    return [zero.optimizer.register_step_pre_hook(enter), zero.optimizer.register_step_post_hook(leave)]


def _cut(tracker, name: str) -> tuple[str, int, dict[str, int], tuple[int, int, int]]:
    """The phase's peak, breakdown and host figures, and a fresh peak for the next."""
    result = tracker.result()
    tracker.reset_peak()
    host = (result.host_peak_bytes, result.to_host_bytes, result.to_device_bytes)
    return name, result.peak_bytes, dict(result.peak_breakdown_bytes), host
