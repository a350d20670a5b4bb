"""The recipes `plan` searches: every axis the simulator covers, grouped into chains that prune each other.

A recipe is one `StepSpec` at AUTO partitions: method (and streambp's head mode), engine and shard stage,
sequence-parallel degree, offload tiers. The axes:

- methods: plain, checkpoint, mst, streambp (streambp once per head mode the objective allows);
- engine and stage: one GPU holds the whole state (shard none); more GPUs: torch FSDP2 zero3 and zero2,
  DeepSpeed ZeRO-3 and ZeRO-2 (what `step.parts.shards` lays out; ZeRO-1 is not simulated, so not searched);
- sequence parallelism: every divisor of the GPU count whose heads the model can split
  (`sequence_layout.check_sequence_parallel`), under FSDP2 only (`config.SP_UNDER_DEEPSPEED`);
- offload tiers: a ladder of nested sets, each rung one tier more (none, checkpoints,
  checkpoints+optimizer, all; without an optimizer none, checkpoints, checkpoints+params; plain none and
  optimizer), so that "more tiers never shorten" orders the rungs.

A chain is one (method, head mode, sp, engine) with its stages strongest first and the ladder: what fails
under a stronger stage (zero3 before zero2) or on a higher rung fails below it, which is what the search
prunes (`recipes.search`). Nothing here imports torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from streambp_core.config import AUTO, FUSED_HEAD_OBJECTIVES, METHODS, ConfigError, StepSpec
from streambp_core.registry import method_class
from streambp_core.tiers import Tiers

GPU_MEMORY_GIB = {"h100": 79.65, "h200": 139.8, "a100": 80.0, "a800": 80.0}
"""Each GPU model's memory as the driver reports it (NVML total, GiB): `--budget-gib`'s default."""

ENGINES = {"none": "one GPU", "zero3": "FSDP2 zero3", "zero2": "FSDP2 zero2",
           "deepspeed-zero3": "DeepSpeed ZeRO-3", "deepspeed-zero2": "DeepSpeed ZeRO-2"}
"""Each shard stage's engine, in words, strongest stage of each engine first."""

FAMILIES = {"fsdp2": ("zero3", "zero2"), "deepspeed": ("deepspeed-zero3", "deepspeed-zero2"),
            "none": ("none",)}
"""The stages of each engine, strongest first: a stage that fails makes the weaker ones fail."""


def ladder(method: str, optimizer: str) -> tuple[Tiers, ...]:
    """The nested tier sets searched for `method`, fewest first (module docstring)."""
    if not method_class(method).keeps_checkpoints:
        return (Tiers.NONE, Tiers(optimizer=True)) if optimizer != "none" else (Tiers.NONE,)
    if optimizer == "none":
        return (Tiers.NONE, Tiers(checkpoints=True), Tiers(checkpoints=True, params=True))
    return (Tiers.NONE, Tiers(checkpoints=True), Tiers(checkpoints=True, optimizer=True), Tiers.ALL)


@dataclass(frozen=True, kw_only=True)
class Chain:
    """Recipes that prune each other: one method, head mode, sp degree and engine; its stages strongest
    first, each over the tier ladder fewest first."""

    base: StepSpec
    """The step without stage or tiers: method, head mode, sp, the user's objective, optimizer, ..."""
    stages: tuple[str, ...]
    rungs: tuple[Tiers, ...]

    def recipe(self, stage: str, tiers: Tiers, seq_len_tokens: int) -> StepSpec:
        """The step of `stage` and `tiers` at `seq_len_tokens` (ConfigError where it cannot run)."""
        return self.base.replaced(shard=stage, offload=tiers, seq_len_tokens=seq_len_tokens)

    @property
    def name(self) -> str:
        engine = "one GPU" if self.stages == ("none",) else ENGINES[self.stages[0]].split()[0]
        return f"{head_label(self.base)} {engine} sp {self.base.sp}"

    @property
    def cost(self) -> float:
        """Relative cost of the chain's simulations (to start the costliest first)."""
        return method_class(self.base.method).search_cost * len(self.stages)


def head_label(spec: StepSpec) -> str:
    """The method, and streambp's head mode: 'streambp (fused head)'."""
    return f"streambp ({spec.stream.head_mode} head)" if spec.method == "streambp" else spec.method


def recipe_label(spec: StepSpec) -> str:
    """A recipe in words: method, engine and stage, sp degree, offload tiers."""
    sp = f", sp {spec.sp}" if spec.sp > 1 else ""
    return f"{head_label(spec)}, {ENGINES[spec.shard]}{sp}, offload {spec.offload}"


def sp_degrees(gpus: int, config) -> tuple[tuple[int, str | None], ...]:
    """Each divisor of `gpus` with None, or with why the model's heads cannot be split over it."""
    from streambp_core.step.simulation.sequence_layout import check_sequence_parallel

    degrees = []
    for sp in (d for d in range(1, gpus + 1) if gpus % d == 0):
        try:
            check_sequence_parallel(StepSpec.of(model="-", method="streambp", gpus=gpus, sp=sp,
                                                shard="zero3", seq_len_tokens=max(2, sp)), config)
            degrees.append((sp, None))
        except ConfigError as error:
            degrees.append((sp, str(error)))
    return tuple(degrees)


def chains(model: str, methods: tuple[str, ...], gpus: int, degrees, **fields: object
           ) -> tuple[list[Chain], list[tuple[str, str]]]:
    """(every chain of the search space, [(recipe group, why refused)] for the axes refused by name).

    `fields`: the user's step settings (objective, optimizer, lora_rank, batch_size, ...)."""
    chosen, refused = [], []
    objective = str(fields.get("objective", "sft"))
    for method in methods or METHODS:
        heads = ("recompute", "fused") if method == "streambp" and objective in FUSED_HEAD_OBJECTIVES \
            else ("recompute",)
        for head in heads:
            for sp, why in degrees:
                families = ("none",) if gpus == 1 else ("fsdp2",) if sp > 1 else ("fsdp2", "deepspeed")
                for family in families:
                    try:
                        base = StepSpec.of(model=model, method=method, gpus=gpus, sp=sp, head_mode=head,
                                           shard=FAMILIES[family][0], partition_size=AUTO,
                                           head_partition_size=AUTO, seq_len_tokens=max(2, sp), **fields)
                    except ConfigError as error:
                        refused.append((f"{method} sp {sp} {family}", str(error)))
                        continue
                    if why is not None:
                        refused.append((f"{head_label(base)}, sp {sp}", why))
                        continue
                    rungs = ladder(method, base.optimizer)
                    chosen.append(Chain(base=base, stages=FAMILIES[family], rungs=rungs))
    return chosen, refused
