"""DeepSpeed ZeRO as an engine: one gradient reduction per parameter per backward, whatever the chunks.

The user's script keeps its shape::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    run = streambp_core.prepare(engine.module, "streambp", ...)
    engine.backward(run.loss(input_ids, labels=labels))
    engine.step()

Why anything is needed: ZeRO reduces a parameter's gradient from a hook that fires after each
accumulation into its `.grad` (`register_post_accumulate_grad_hook`). A streamed backward accumulates a
layer's weight gradients chunk by chunk, some through autograd (a hook firing per chunk: ZeRO-2 asserts
"multiple gradient reduction", or reduces a partial sum), some by hand into `.grad` (no firing at all:
never reduced). A tied embedding and head is fed from two places in one step.

Mechanism (`streambp_core.engine.reduction.OneReduction`, armed by every non-plain run's `loss`): a side
buffer handed to autograd once, with `ds_grad_is_ready` silencing the firings before it.
1. When `run.loss` builds the loss, every trainable parameter gets `ds_grad_is_ready = False`
   (DeepSpeed >= 0.17.0: `reduce_independent_p_g_buckets_and_remove_grads` in `stage_1_and_2.py`
   returns before reducing while it is False), so every firing during the streamed backward leaves the
   gradient where it is, summing in `.grad`.
2. A hook on the loss queues one callback at the end of the outer backward. There, with every chunk of
   every layer and both uses of a tied weight done, each parameter's summed gradient is taken out of
   `.grad` (the side buffer), the flag is set back to True, and one `torch.autograd.backward` through
   `p.view_as(p)` with those gradients fires each parameter's hook exactly once, in reverse layer order
   (the order of plain backprop, so DeepSpeed's buckets fill as usual).

Per stage:
- ZeRO-2 reduces from the hook on every micro-step: without the deferral it asserts (a second firing)
  or never reduces a hand-written gradient; with it, one reduction per parameter per micro-step.
- ZeRO-1 without `overlap_comm` reduces at the accumulation boundary from `.grad` (`reduce_gradients`)
  and would be exact without help; with `overlap_comm` it reduces from the hook as ZeRO-2 does. The same
  deferral serves both (one reduction per parameter per step, counted in the tests).
- ZeRO-3: refused for every method but plain. Its parameters are partitioned and gathered by module
  hooks that streambp's and mst's layers (which read a layer's pieces directly) do not go through, and
  its gradients are partitioned in a way this mechanism is not checked on. So no chunk ever issues a
  collective under DeepSpeed: a chunk count differing between ranks cannot deadlock (FSDP2's zero3 is
  the sharded-parameter engine here, gathering once per layer, not per chunk).

Why not the flag alone, cleared at a parameter's last firing: the engine writes most linear weight
gradients by hand into `.grad` (no hook), so the last firing of a parameter is not a point the flag can
mark; the single firing through `view_as` is. The cost, against ZeRO-2's own schedule: full gradients
are held until the end of the backward, as `engine.coalesce_grad_reduction()` does (no overlap of
reduction with backward).

Refused by name (`check_engine`, `prepare`): DeepSpeed below 0.17.0 (no `ds_grad_is_ready`), a stage
other than 1, 2, 3, every method but plain under ZeRO-3, and `BF16_Optimizer` with
`immediate_grad_update` on DeepSpeed before 0.19.8 (it over-counts).
"""

from __future__ import annotations

from streambp_core.config import ConfigError
from streambp_core.engine.reduction import (
    MIN_VERSION,
    OneReduction,
    check_version,
    installed_version,
    version_tuple,
    zero_stage_of,
)

__all__ = ["MIN_VERSION", "OneReduction", "STAGES", "check_engine", "check_installed", "check_stage",
           "version_tuple", "zero_config", "zero_stage_of"]

BF16_IMMEDIATE_FIXED = (0, 19, 8)
"""Before it, `BF16_Optimizer` with `immediate_grad_update` counts a deferred gradient more than once."""

STAGES = {"zero1": 1, "zero2": 2, "zero3": 3}
"""The `--shard` names of the ZeRO stages."""


def check_stage(shard: str) -> int:
    """The ZeRO stage of a `--shard` name; ConfigError for any other."""
    if shard not in STAGES:
        raise ConfigError(f"deepspeed shard must be one of {', '.join(STAGES)}, got {shard!r}")
    return STAGES[shard]


def check_installed() -> str:
    """The installed DeepSpeed's version, after refusing a missing one or one below the floor."""
    version = installed_version()
    check_version(version)
    return version


def check_engine(engine) -> int:
    """The ZeRO stage of a `DeepSpeedEngine`, after refusing what cannot be exact (module docstring)."""
    version = check_installed()
    stage = int(engine.zero_optimization_stage())
    if stage not in STAGES.values():
        raise ConfigError(f"deepspeed zero stage must be 1, 2 or 3, got {stage}")
    optimizer = getattr(engine, "optimizer", None)
    immediate = getattr(optimizer, "immediate_grad_update", False)
    if type(optimizer).__name__ == "BF16_Optimizer" and immediate and \
            version_tuple(version) < BF16_IMMEDIATE_FIXED:
        raise ConfigError(f"BF16_Optimizer with immediate_grad_update on deepspeed {version} counts a "
                          "deferred gradient more than once; use deepspeed>=0.19.8 or turn it off")
    return stage


def zero_config(stage: int, *, micro_batch: int, accumulation: int = 1, lr: float = 1e-3) -> dict:
    """A DeepSpeed config for ZeRO `stage` in the parameters' own dtype (no fp16/bf16 section: float32
    or float64 master weights), torch's Adam (no compiled op) without weight decay (DeepSpeed's Adam is
    AdamW, whose torch default decays by 0.01) and without clipping (DeepSpeed clips at norm 1.0 unless
    told). ZeRO keeps float32 master weights whatever the parameters' dtype. ZeRO-3 partitions every
    parameter (`stage3_param_persistence_threshold` 0: by default it keeps those under 1e5 elements whole
    on every rank, which would be all of a tiny model's)."""
    zero = {"stage": stage}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    return {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
            "optimizer": {"type": "Adam", "params": {"lr": lr, "weight_decay": 0.0, "torch_adam": True}},
            "zero_optimization": zero, "gradient_clipping": 0.0, "steps_per_print": 1 << 30}
