"""DeepSpeed ZeRO as an engine: one gradient reduction per parameter per backward, whatever the chunks.

The user's script keeps its shape, with the engine itself prepared::

    engine, optimizer, _, _ = deepspeed.initialize(model=model, config=config, ...)
    run = streambp_core.prepare(engine, "streambp", ...)      # engine.module is what the run prepares
    engine.backward(run.loss(input_ids, labels=labels))
    engine.step()

`run.loss` runs as the engine's forward (`engine.engines.reduction.through_engine`): ZeRO-3 counts
micro-steps there
and, without it, overwrites rather than accumulates the micro-steps' gradients; `prepare(engine.module)`
is refused by name under ZeRO-3 (ZeRO-1/2 accept it).

Why anything is needed: ZeRO reduces a parameter's gradient from a hook that fires after each
accumulation into its `.grad` (`register_post_accumulate_grad_hook`). A streamed backward accumulates a
layer's weight gradients chunk by chunk, some through autograd (a hook firing per chunk: ZeRO-2 asserts
"multiple gradient reduction", or reduces a partial sum), some by hand into `.grad` (no firing at all:
never reduced). A tied embedding and head is fed from two places in one step. ZeRO-3 also gathers a
module's parameters around each call of it, which a chunk loop would turn into per-chunk collectives.

Mechanisms, chosen per method (both rely on `ds_grad_is_ready`, DeepSpeed >= 0.17.0: the stage-1/2 and
stage-3 hooks leave the gradient in `.grad`, unreduced, while it is False):
- streambp and mst (`Run.drives_modules`), every stage: units (`engine.engines.zero3.Zero3Units`: streambp's
  decoder layers and head, mst's chunked MLPs and head). While a unit's backward runs, its parameters'
  flags are False; as it ends, a bracket on its input sets them, takes each summed gradient out of
  `.grad` (zeros where none arrived) and returns it to autograd, whose accumulation fires each hook once:
  the gradient is reduced as its layer completes, as ZeRO-2 and ZeRO-3 schedule it for plain backprop.
  Under ZeRO-3 the unit is also gathered once for its forward and once for its backward, with
  DeepSpeed's own hooks taken off the unit's modules while the run is open: no chunk issues a
  collective, so ranks with different lengths (chunk counts) cannot deadlock (counted in the tests).
  An MoE block DeepSpeed marks as a leaf module is reduced from its leaf hook, called once by the unit.
- checkpoint, ZeRO-1/2 (`engine.engines.reduction.OneReduction`, armed on every loss): every flag False for
the
  backward; at its end (a callback queued on autograd's engine) each summed gradient goes to autograd
  once through `p.view_as(p)`, in reverse layer order. Full gradients are held until then (as
  `engine.coalesce_grad_reduction()` does). Under ZeRO-3, checkpoint and plain need nothing: each
  parameter's hook fires once through transformers' modules (an MoE block holding one module per
  expert must be a leaf module, DeepSpeed's default for the known ones, refused by name otherwise;
  experts fused into 3-D parameters, transformers 5's, fire once whatever the routing).
- plain: the model untouched.

Per stage: ZeRO-2 and ZeRO-3 reduce from the hooks on every micro-step; ZeRO-1 without `overlap_comm`
reduces at the accumulation boundary from `.grad` and would be exact without help, with `overlap_comm`
as ZeRO-2; the same mechanisms serve all three (one reduction per parameter per micro-step, per step on
ZeRO-1, counted in the tests).

Offload (`engine.engines.deepspeed_tiers`): under DeepSpeed the project's optimizer and params tiers are
DeepSpeed's own sections, `offload_optimizer` (fp32 masters, moments and gradient partitions in host
memory, stepped there by its CPU Adam) and `offload_param` (ZeRO-3's partitions in host memory; the
units gather them as any partition); `offload_sections` writes them for a tier set, and `prepare(engine,
..., offload=...)` checks that the engine's config has them on and holds no host tier itself (the
checkpoints tier stays the method's). Checked on two gloo CPU ranks (`deepspeed_verify`, `offload=`):
every method under ZeRO-3 with both sections hands its optimizer the gradient it hands it without them
(bitwise), and the applied update is that optimizer's step on it (torch's Adam or DeepSpeed's CPU Adam,
bitwise), one reduction per parameter. `step.simulation.deepspeed_host` lays the rank out.

Refused by name (`check_engine`, `prepare`): DeepSpeed below 0.17.0 (no `ds_grad_is_ready`), a stage
other than 1, 2, 3, the optimizer or params tier under an engine whose config does not offload it (or
under `prepare(engine.module)`, whose config cannot be read), params below ZeRO-3 (DeepSpeed has no
`offload_param` there), and `BF16_Optimizer` with `immediate_grad_update` on DeepSpeed before 0.19.8
(it over-counts).
"""

from __future__ import annotations

from streambp_core.config import ConfigError, offload_choice
from streambp_core.engine.engines.deepspeed_tiers import OFFLOAD_SECTIONS
from streambp_core.engine.engines.reduction import (
    MIN_VERSION,
    OneReduction,
    check_version,
    installed_version,
    version_tuple,
    zero_stage_of,
)
from streambp_core.tiers import Tiers

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


def zero_config(stage: int, *, micro_batch: int, accumulation: int = 1, lr: float = 1e-3,
                offload: Tiers | str = Tiers.NONE, cpu_adam: bool = False, optimizer: str = "adam") -> dict:
    """A DeepSpeed config for ZeRO `stage` in the parameters' own dtype (no fp16/bf16 section: float32
    or float64 master weights), Adam without weight decay (DeepSpeed's Adam is AdamW, whose torch default
    decays by 0.01) and without clipping (DeepSpeed clips at norm 1.0 unless told). ZeRO keeps float32
    master weights whatever the parameters' dtype. ZeRO-3 partitions every parameter
    (`stage3_param_persistence_threshold` 0: by default it keeps those under 1e5 elements whole on every
    rank, which would be all of a tiny model's).

    `offload`: the project's tiers (a `Tiers` or what `Tiers.of` reads) as DeepSpeed's sections
    (`offload_sections`). The optimizer is torch's
    Adam (no compiled op; with `offload_optimizer` DeepSpeed is told to accept it,
    `zero_force_ds_cpu_optimizer` false), or with `cpu_adam` and the optimizer tier DeepSpeed's own
    `DeepSpeedCPUAdam` (compiled on first use), what a user of `offload_optimizer` runs.

    `optimizer` "sgd": no optimizer section; the caller hands `deepspeed.initialize` its own
    `torch.optim.SGD` (a client optimizer, which ZeRO is told to accept: `zero_allow_untested_optimizer`)."""
    zero = {"stage": stage, **offload_sections(offload_choice(offload), stage)}
    if stage == 3:
        zero["stage3_param_persistence_threshold"] = 0
    cpu_adam = cpu_adam and "offload_optimizer" in zero
    adam = {"lr": lr, "weight_decay": 0.0, "torch_adam": not cpu_adam}
    config = {"train_micro_batch_size_per_gpu": micro_batch, "gradient_accumulation_steps": accumulation,
              "optimizer": {"type": "Adam", "params": adam}, "zero_optimization": zero,
              "gradient_clipping": 0.0, "steps_per_print": 1 << 30}
    if "offload_optimizer" in zero and not cpu_adam:
        config["zero_force_ds_cpu_optimizer"] = False
    if optimizer == "sgd":
        del config["optimizer"]
        config["zero_allow_untested_optimizer"] = True
    elif optimizer != "adam":
        raise ConfigError(f"deepspeed optimizer must be adam or sgd, got {optimizer!r}")
    return config


def offload_sections(offload: Tiers, stage: int) -> dict:
    """DeepSpeed's `zero_optimization` sections for the project's tier set `offload`: the
    optimizer tier is `offload_optimizer`, params is `offload_param` (ZeRO-3 only), both on the CPU; the
    checkpoints tier has none (the methods offload their checkpoints themselves: `prepare(engine, ...,
    offload="checkpoints")`). ConfigError for params below ZeRO-3."""
    if offload.params and stage != 3:
        raise ConfigError(f"deepspeed offloads parameters under zero3 only (offload_param), got zero{stage}")
    return {OFFLOAD_SECTIONS[tier]: {"device": "cpu"} for tier in offload.names if tier in OFFLOAD_SECTIONS}
