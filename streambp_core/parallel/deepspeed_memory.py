"""One rank's memory under DeepSpeed ZeRO, measured: the step run for real on CPU ranks (gloo) under the
memory tracker, the counterpart of the `deepspeed-zero2`/`deepspeed-zero3` layouts (`step.shards`).

`measure_deepspeed_ranks(specs, config)` starts `gpus` ranks (`launch.run_ranks`). For each spec, each
rank builds the spec's model in bf16 with seeded weights, hands it to `deepspeed.initialize` (ZeRO stage
2 or 3, bf16, torch's AdamW on the fp32 partitions, DeepSpeed's default buckets: what the layouts
assume), prepares the engine for the spec's method and runs one untracked step (DeepSpeed allocates its
gradient partition, fp32 gradient and AdamW's moments on the first) and then one step under the tracker
(`count_existing`: every storage made before, DeepSpeed's flat buffers included, counts from the first
op that reads it), cutting phases at the loss, after `engine.backward` and after `engine.step`. Ranks run
the same sequence; rank 0's figures come back.

Not seen by the tracker: what gloo allocates inside a collective, and a storage that exists but that no
op reads during the step (DeepSpeed's fp32 partitions are read by the step; the bf16 weights by the
forward): under such a storage's weight the measured peak is low, never high.
"""

from __future__ import annotations

from collections.abc import Sequence

from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec
from streambp_core.parallel.launch import DEFAULT_TIMEOUT_S, check_nproc, run_ranks
from streambp_core.parallel.memory import RankMemory

STAGES = {"deepspeed-zero2": 2, "deepspeed-zero3": 3}
"""The layouts measured, by ZeRO stage."""


def deepspeed_config(stage: int) -> dict:
    """DeepSpeed's config for a measured rank: bf16, ZeRO `stage` with its default buckets, torch's AdamW
    (fp32 master weights and moments), no clipping."""
    return {"train_micro_batch_size_per_gpu": 1, "gradient_accumulation_steps": 1, "bf16": {"enabled": True},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-5, "torch_adam": True}},
            "zero_optimization": {"stage": stage}, "gradient_clipping": 0.0, "steps_per_print": 1 << 30}


def measure_deepspeed_ranks(specs: Sequence[StepSpec], config: PretrainedConfig, *,
                            timeout_s: float = DEFAULT_TIMEOUT_S) -> list[RankMemory]:
    """Rank 0's tracked step of each spec (module docstring); the specs share a model and rank count,
    bf16, AdamW, a DeepSpeed layout. ConfigError for anything else or more ranks than cores."""
    if not specs:
        raise ConfigError("give at least one spec")
    if len({(spec.model, spec.gpus) for spec in specs}) != 1:
        raise ConfigError("measured ranks run one model on one rank count; the specs differ")
    for spec in specs:
        if spec.shard not in STAGES or spec.dtype != "bfloat16" or spec.optimizer != "adamw":
            raise ConfigError(f"a DeepSpeed rank is measured as the layouts assume it ({', '.join(STAGES)}, "
                              f"bfloat16, adamw), got {spec.shard}, {spec.dtype}, {spec.optimizer}")
    check_nproc(specs[0].gpus, "cpu")
    steps = run_ranks(_rank_steps, specs[0].gpus, args=(tuple(specs), config), timeout_s=timeout_s)[0]
    out = []
    for spec, phases in zip(specs, steps, strict=True):
        _, peak, breakdown = max(phases, key=lambda phase: phase[1])
        out.append(RankMemory(spec=spec, peak_bytes=peak, breakdown_bytes=breakdown,
                                       phase_peaks_bytes={name: bytes_ for name, bytes_, _ in phases}))
    return out


def _rank_steps(rank: int, world: int, specs: tuple[StepSpec, ...], config: PretrainedConfig):
    """Body of each rank: per spec, a fresh engine, one untracked step and one tracked step; per phase
    (name, peak, breakdown)."""
    import deepspeed

    deepspeed.init_distributed(dist_backend="gloo")
    return [_tracked_engine_step(spec, config) for spec in specs]


def _tracked_engine_step(spec: StepSpec, config: PretrainedConfig) -> list[tuple[str, int, dict[str, int]]]:
    import deepspeed
    import torch

    import streambp_core
    from streambp_core.measure.tracker import MemoryTracker
    from streambp_core.models import build_model
    from streambp_core.step.setup import step_inputs

    model = build_model(config, dtype=torch.bfloat16, device="cpu", seed=spec.seed, checked=True)
    engine, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                           config=deepspeed_config(STAGES[spec.shard]))
    inputs = step_inputs(spec, config.vocab_size, "cpu")
    phases = []
    with streambp_core.prepare(engine, spec.method, spec.stream) as run:
        for tracked in (False, True):
            if not tracked:
                engine.backward(run.loss(**inputs))
                engine.step()
                continue
            with MemoryTracker(engine.module, engine.optimizer.optimizer, device="cpu",
                               count_existing=True) as tracker:
                loss = run.loss(**inputs)
                phases.append(_cut(tracker, "forward"))
                engine.backward(loss)
                del loss
                phases.append(_cut(tracker, "backward"))
                engine.step()
                phases.append(_cut(tracker, "optimizer"))
    return phases


def _cut(tracker, name: str) -> tuple[str, int, dict[str, int]]:
    """The phase's peak and breakdown, and a fresh peak for the next."""
    result = tracker.result()
    tracker.reset_peak()
    return name, result.peak_bytes, dict(result.peak_breakdown_bytes)
