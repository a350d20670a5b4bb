"""Trainer parity on sharded engines: the pieces of a check on N CPU ranks under accelerate's FSDP2 or
DeepSpeed plugin. The ranks are started by `streambp_bench.verify.trainer_ranks.run_sharded_parity`
(the launcher sits beside this package, in `parallel`); this module holds what each rank runs and how
the figures are judged.

Steps:
1. The reference: single-process plain training of the same model on the same rows, `nproc` times the
   per-rank batch, the same gradient accumulation (data parallelism's global batch; `global_batch`).
   On DeepSpeed the reference is that training on one DeepSpeed rank (float32 master weights on both
   sides), with single-process float64 plain without an engine reported beside it. GRPO samples its
   completions from each process's generator, so its reference is plain on the same engine and ranks.
2. `nproc` ranks each build the trainers as `accelerate launch` would configure them (the plugin from
   the same environment variables, `engine_environment`) and train plain, then each method with
   `stream_trainer` (`rank_train`); every parameter is gathered to a full tensor after training.
3. Each method's update (after - before) is compared with the reference's and with plain's on the same
   engine, per group of parameters (`compare_sharded`, `parity.group_errors`).

CPU ranks: accelerate 1.15 takes its FSDP plugin only on accelerator devices (MULTI_GPU and the like)
and its DeepSpeed plugin only when not told `cpu=True`. So each rank starts accelerate's `PartialState`
over the gloo group itself and declares the distributed type `accelerate launch` gives GPU ranks
(MULTI_GPU for FSDP, DEEPSPEED); the trainer then takes it (`use_configured_state`). Everything after
(the plugin, `Accelerator.prepare`, `fsdp2_prepare_model`, `deepspeed.initialize`) runs as on GPUs.

On DeepSpeed each trainable parameter's reductions are counted per micro-step (per step on ZeRO-1;
`streambp_bench.verify.trainer_ranks.ReductionCount`), and a method passes only if each is reduced
exactly once. The models are built
outside `deepspeed.zero.Init` (`parity_setup.build_user_model`), as the reference's are, or with
`ParitySetup.zero3_init` each inside it, loaded from weights after its trainer's arguments; ZeRO-3
partitions every parameter (`deepspeed_settings`) and the updates are gathered whole (`full_tensors`).

Tolerances (`sharded_tolerance`): FSDP2 keeps the weights' dtype, so float64 runs are held to
`update_tolerance` (1e-10 with SGD). DeepSpeed ZeRO-1/2/3 step float32 master weights whatever the
parameters' dtype, so its figures are held to float32's bound. TRL's trainers score tokens with TRL's
fused LM head, which sums in float32 buffers whatever the weights' dtype: against single-process plain
(a batch split differently) they are held to float32's bound too, against plain on the same engine to
the weights' dtype's.
"""

from __future__ import annotations

import os
import tempfile
from dataclasses import dataclass, replace

from streambp_core.config import ConfigError
from streambp_core.verify.trainer_parity import (
    MethodParity,
    check_optimizer,
    group_errors,
    train_updates,
    update_tolerance,
)
from streambp_core.verify.trainer_setup import ParitySetup, trainer_factory

ENGINE_SHARDS = {"fsdp2": ("zero2", "zero3"), "deepspeed": ("zero1", "zero2", "zero3")}
"""The `--shard` names of each engine."""
FLOAT32_TOLERANCE = 1e-4
"""Where float32 arithmetic is forced: float32's bound of `verify`. (Three steps of Adam from float32
masters amplify a float32 rounding difference where a gradient element is near Adam's eps, which the
DeepSpeed verify separates out by checking the reduced gradient and the step apart; a trainer's state
after three steps has no such seam.)"""
RANK_TIMEOUT_S = 600.0
"""Process-group timeout of the ranks (a trainer's start-up and three steps on CPU)."""
ACCUMULATION_STEPS = 2
"""Micro-steps per optimizer step of a sharded parity run (unless the settings say otherwise)."""


@dataclass(frozen=True, kw_only=True)
class ShardedParity:
    """One method on one engine: its update against the reference and against plain on the engine."""

    engine: str
    shard: str
    nproc: int
    reference: str
    """What `against_reference` compares with: 'single-process plain' or 'plain on the engine'."""
    against_reference: MethodParity
    against_engine_plain: MethodParity
    float64_plain_error: float | None = None
    """DeepSpeed only: the largest group error against single-process float64 plain without an engine
    (reported, not judged: float32 master weights round each update at their resolution)."""
    reductions: dict[str, int] | None = None
    """DeepSpeed only: over rank 0's micro-steps (steps on ZeRO-1), how many trainable parameters ZeRO
    reduced 0, 1 or more times ('0', '1', '2+'; `streambp_bench.verify.trainer_ranks.ReductionCount`)."""

    @property
    def ok(self) -> bool:
        once = self.reductions is None or set(self.reductions) == {"1"}
        return self.against_reference.ok and self.against_engine_plain.ok and once

    def to_dict(self) -> dict:
        return {"engine": self.engine, "shard": self.shard, "nproc": self.nproc, "reference": self.reference,
                "ok": self.ok, "against_reference": self.against_reference.to_dict(),
                "against_engine_plain": self.against_engine_plain.to_dict(),
                "float64_plain_error": self.float64_plain_error, "reductions": self.reductions}


def check_sharded(setup: ParitySetup, engine: str, shard: str, methods) -> None:
    """ConfigError, before any rank starts, for what a sharded trainer check cannot run."""
    if engine not in ENGINE_SHARDS:
        raise ConfigError(f"--engine must be one of {', '.join(ENGINE_SHARDS)}, got {engine!r}")
    if shard not in ENGINE_SHARDS[engine]:
        shards = ", ".join(ENGINE_SHARDS[engine])
        raise ConfigError(f"--shard for {engine} must be one of {shards}, got {shard!r}")
    if setup.device != "cpu":
        raise ConfigError("a sharded trainer check runs on cpu ranks (gloo); use --device cpu")
    if engine == "deepspeed":
        from streambp_core.integrations.engines import deepspeed_refusals

        plugin = _Plugin({"zero_optimization": {"stage": int(shard[-1])}})
        for refused, setting, why in deepspeed_refusals(plugin):
            if refused:
                raise ConfigError(f"{setting} cannot train a {', '.join(methods)} model: {why}")
    update_tolerance("sgd", setup.dtype)  # float64 or float32 only


def check_settings(setup: ParitySetup) -> None:
    """ConfigError, before any rank starts, for a setting the trainer's optimizer refuses: a probe
    trainer of `setup` in this process, without an engine, builds its optimizer
    (`trainer_parity.check_optimizer`)."""
    with tempfile.TemporaryDirectory(prefix="streambp-parity-") as output_dir:
        check_optimizer(trainer_factory(replace(setup, zero3_init=False), output_dir)())


@dataclass(frozen=True)
class _Plugin:
    deepspeed_config: dict


def compare_sharded(engine: str, shard: str, nproc: int, setup: ParitySetup, method: str, reference_name: str,
                    reference: dict, updates: dict, tied: bool, float64_plain: dict | None,
                    reductions: dict | None = None) -> ShardedParity:
    """`method`'s updates against `reference` and against plain's on the engine (`updates['plain']`);
    `float64_plain` (DeepSpeed) is reported beside them, with `reductions` (DeepSpeed: `rank_train`'s
    tally per method)."""
    tolerance = sharded_tolerance(setup, engine, reference_name)
    engine_tolerance = sharded_tolerance(setup, engine, "plain on the engine")
    float64_error = None
    if float64_plain is not None:
        groups = group_errors(float64_plain, updates[method], tied)
        float64_error = max((g.rel_error for g in groups), default=0.0)
    return ShardedParity(
        engine=engine, shard=shard, nproc=nproc, reference=reference_name,
        against_reference=MethodParity(method, group_errors(reference, updates[method], tied), tolerance),
        against_engine_plain=MethodParity(method, group_errors(updates["plain"], updates[method], tied),
                                          engine_tolerance),
        float64_plain_error=float64_error, reductions=None if reductions is None else reductions[method])


def sharded_tolerance(setup: ParitySetup, engine: str, reference_name: str) -> float:
    """The update tolerance against `reference_name`: `update_tolerance` of the optimizer and dtype,
    raised to float32's bound where float32 arithmetic is forced (module docstring): DeepSpeed's master
    weights, and TRL's fused LM head against single-process plain (its `ChunkedLogProbFunction` sums
    log-sum-exp and head gradients in float32 buffers, so a batch split across ranks rounds differently;
    plain on the engine splits it the same way)."""
    tolerance = update_tolerance(setup.settings.get("optim", "sgd"), setup.dtype)
    trl_head = setup.trainer != "trainer" and reference_name != "plain on the engine"
    float32_forced = engine == "deepspeed" or trl_head
    return max(tolerance, FLOAT32_TOLERANCE) if float32_forced else tolerance


def global_batch(setup: ParitySetup, nproc: int) -> ParitySetup:
    """`setup` with `nproc` times its per-rank batch: what data parallelism over `nproc` ranks trains."""
    from streambp_core.verify.trainer_setup import DEFAULT_SETTINGS

    name = "per_device_train_batch_size"
    per_rank = setup.settings.get(name, DEFAULT_SETTINGS[name])
    return replace(setup, settings={**setup.settings, name: per_rank * nproc})


def single_process_plain(setup: ParitySetup, nproc: int) -> dict:
    """Plain training in this process, no engine, on the global batch (`nproc` x the per-rank batch)."""
    with tempfile.TemporaryDirectory(prefix="streambp-parity-") as output_dir:  # no engine: nothing to init
        plain = replace(global_batch(setup, nproc), zero3_init=False)
        updates, _, _ = train_updates(trainer_factory(plain, output_dir), None, {})
    return updates


def engine_environment(engine: str, shard: str) -> dict[str, str]:
    """The environment `accelerate launch` gives a rank for `examples/accelerate/*.yaml` of this engine:
    FSDP2 with one unit per decoder layer (the model's `_no_split_modules`), or DeepSpeed's plugin."""
    if engine == "fsdp2":
        return {"ACCELERATE_USE_FSDP": "true", "FSDP_VERSION": "2",
                "FSDP_RESHARD_AFTER_FORWARD": str(shard == "zero3").lower(),
                "FSDP_AUTO_WRAP_POLICY": "TRANSFORMER_BASED_WRAP"}
    return {"ACCELERATE_USE_DEEPSPEED": "true", "ACCELERATE_DEEPSPEED_ZERO_STAGE": shard[-1]}


def deepspeed_settings(shard: str) -> dict:
    """The trainer's DeepSpeed config for ZeRO `shard`: the batch, accumulation and clipping the trainer's
    arguments give ("auto"), the trainer's own optimizer (float32 masters in ZeRO)."""
    zero = {"stage": int(shard[-1])}
    if shard == "zero3":  # partition every parameter (by default those under 1e5 elements stay whole)
        zero["stage3_param_persistence_threshold"] = 0
    return {"deepspeed": {"train_micro_batch_size_per_gpu": "auto", "train_batch_size": "auto",
                          "gradient_accumulation_steps": "auto", "gradient_clipping": "auto",
                          "zero_allow_untested_optimizer": True, "steps_per_print": 1 << 30,
                          "zero_optimization": zero}}


def _declare_engine(engine: str) -> None:
    """accelerate's state over this rank's gloo group, of the distributed type GPU ranks of `engine`
    get (module docstring)."""
    from accelerate import PartialState
    from accelerate.utils import DistributedType

    state = PartialState(cpu=True, backend="gloo")
    state.distributed_type = DistributedType.MULTI_GPU if engine == "fsdp2" else DistributedType.DEEPSPEED
    if engine == "deepspeed":  # as accelerate's state does for DeepSpeed ranks, before any model is built
        import deepspeed

        deepspeed.init_distributed(dist_backend="gloo")


def rank_train(rank: int, world: int, setup: ParitySetup, engine: str, shard: str, methods, options,
               reduction_count=None):
    """Body of each rank (`parallel.launch.run_ranks`): trains plain, then each of `methods`, under the
    plugin `accelerate launch` configures for `engine` and `shard`; ({method or 'plain': updates}, tied,
    {method: reductions} on DeepSpeed, else None) on rank 0, None elsewhere. `reduction_count(shard)`
    makes the `TrainerCallback` that counts DeepSpeed's reductions (its `trainer` set, its `tallies`
    read; `streambp_bench.verify.trainer_ranks.ReductionCount`). What the libraries print here goes to
    stderr, as every rank's does (`parallel.launch`): the caller's stdout holds only its report (`--json`)."""
    os.environ.update(engine_environment(engine, shard))
    _declare_engine(engine)  # before any TrainingArguments: they take the configured state
    settings = {**setup.settings, "use_cpu": False, "accelerator_config": {"use_configured_state": True}}
    if engine == "deepspeed":
        settings.update(deepspeed_settings(shard))
    rank_setup = replace(setup, settings=settings)
    updates, reductions, tied = {}, {}, False
    with tempfile.TemporaryDirectory(prefix="streambp-parity-") as output_dir:
        make = trainer_factory(rank_setup, output_dir)
        for method in ("plain", *methods):
            _fresh_accelerator(engine)
            counter = reduction_count(shard) if engine == "deepspeed" and reduction_count else None
            updates[method], tied, trainer = train_updates(_counted(make, counter), None if method ==
                                                           "plain" else method, options)
            reductions[method] = None if counter is None else dict(counter.tallies)
            del trainer
    if rank != 0:
        return None
    return updates, tied, reductions if reduction_count and engine == "deepspeed" else None


def _counted(make, counter):
    """`make`, with `counter` (a `TrainerCallback`, or None) added to the trainer it builds."""
    def counted_make():
        trainer = make()
        if counter is not None:
            counter.trainer = trainer
            trainer.add_callback(counter)
        return trainer

    return counted_make


def _fresh_accelerator(engine: str) -> None:
    """Forget the previous trainer's accelerator (one per process takes a plugin) and declare the
    engine's distributed type again (the accelerator wrote its own over it), keeping the process group."""
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(reset_partial_state=False)
    GradientState._reset_state()
    _declare_engine(engine)

