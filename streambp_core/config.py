"""Frozen, validated configuration objects shared by the engine, the methods and the benchmarks: `StepSpec`
(every setting of one step) here, its `stream` (`stream_config.StreamConfig`), the rules both are checked by
(`rules`) and the settings' choices (`choices`), which this module also gives under their names."""

from __future__ import annotations

from dataclasses import dataclass, fields, replace

from streambp_core.choices import ATTN_BACKENDS as ATTN_BACKENDS
from streambp_core.choices import AUTO as AUTO
from streambp_core.choices import BASELINE_ATTENTION as BASELINE_ATTENTION
from streambp_core.choices import BASELINE_LOSSES as BASELINE_LOSSES
from streambp_core.choices import DEEPSPEED_SHARDS as DEEPSPEED_SHARDS
from streambp_core.choices import DEVICES as DEVICES
from streambp_core.choices import DTYPES as DTYPES
from streambp_core.choices import FSDP_STAGES as FSDP_STAGES
from streambp_core.choices import FUSED_HEAD_OBJECTIVES as FUSED_HEAD_OBJECTIVES
from streambp_core.choices import GPU_MODEL_NAMES as GPU_MODEL_NAMES
from streambp_core.choices import GRADS_MODES as GRADS_MODES
from streambp_core.choices import HEAD_MODES as HEAD_MODES
from streambp_core.choices import METHODS as METHODS
from streambp_core.choices import MIN_AUTO_PARTITION as MIN_AUTO_PARTITION
from streambp_core.choices import OBJECTIVES as OBJECTIVES
from streambp_core.choices import OPTIMIZERS as OPTIMIZERS
from streambp_core.choices import PADDINGS as PADDINGS
from streambp_core.choices import PARTITION_FIELDS as PARTITION_FIELDS
from streambp_core.choices import PROTOCOLS as PROTOCOLS
from streambp_core.choices import SHARD_MODES as SHARD_MODES
from streambp_core.choices import VERIFY_METHODS as VERIFY_METHODS
from streambp_core.choices import (
    Dtype,
    Grads,
    Method,
    Optimizer,
    Protocol,
    Shard,
)
from streambp_core.errors import ConfigError as ConfigError
from streambp_core.inputs import MAX_BUDGET_GIB as MAX_BUDGET_GIB
from streambp_core.inputs import PRESET_DIR as PRESET_DIR
from streambp_core.inputs import available_cpus as available_cpus
from streambp_core.inputs import check_budget_gib as check_budget_gib
from streambp_core.inputs import preset_names as preset_names
from streambp_core.inputs import sequence_group_problem as sequence_group_problem
from streambp_core.inputs import simulated_ranks_problem as simulated_ranks_problem
from streambp_core.registry import method_class
from streambp_core.rules import SP_UNDER_DEEPSPEED as SP_UNDER_DEEPSPEED
from streambp_core.rules import check_method as check_method
from streambp_core.rules import check_offload as check_offload
from streambp_core.rules import offload_choice as offload_choice
from streambp_core.rules import packing_problem as packing_problem
from streambp_core.rules import require_choice as require_choice
from streambp_core.rules import require_positive as require_positive
from streambp_core.stream_config import STREAM_FIELDS as STREAM_FIELDS
from streambp_core.stream_config import StreamConfig as StreamConfig
from streambp_core.stream_config import require_sized as require_sized
from streambp_core.tiers import OFFLOAD_MODES as TIER_SETS
from streambp_core.tiers import Tiers

OFFLOAD_MODES = TIER_SETS
"""Which parts of a step live in host memory: "none", or a canonical comma list of tiers (checkpoints,
optimizer, params; see `streambp_core.tiers`)."""
SOURCES = {"sim": "simulated", "cpu": "measured-cpu", "cuda": "measured-cuda"}
"""How a figure of a step run on each device was obtained, as every result row says."""


@dataclass(frozen=True, kw_only=True)
class StepSpec:
    """Every setting of one training step: the one description the CLI builds and the core consumes.

    The engine's settings (objective, partitions, attention, LM head, offload) are the step's `stream`, a
    `StreamConfig`, handed to `prepare` as they are. Validated once, here; nothing downstream re-validates
    it (`replaced` re-runs the checks, which need no torch). A max-length search varies only
    `seq_len_tokens` (`spec.at(n)`).
    """

    model: str
    """Preset name (`streambp-bench presets`) or a local directory with config.json."""
    method: Method
    """plain, checkpoint, mst or streambp."""
    seq_len_tokens: int = 4096
    """Tokens per sequence (>= 2)."""
    batch_size: int = 1
    """Sequences (sft), completions in the group (grpo) or chosen/rejected pairs (dpo)."""
    lora_rank: int = 0
    """0: full-parameter training; R > 0: LoRA adapters of rank R (peft, alpha 4R) on every linear."""
    optimizer: Optimizer = "none"
    """none (backprop only) or adamw (a full training step; its moments exist before the step)."""
    dtype: Dtype = "bfloat16"
    protocol: Protocol = "default"
    """default (this project's step), paper (the paper's script; backprop-only steps) or trl (the baselines'
    GRPO and DPO losses as TRL 0.17's trainers compute them, with GRPOTrainer's sampling temperature)."""
    grads: Grads = "auto"
    """resident (zero gradients exist before the step: a gradient-accumulation micro-step) or fresh (the
    step makes them); auto resolves to fresh with an optimizer (its step sets them to None), else
    resident."""
    seed: int = 0
    """Seed of the random weights and tokens of a measured step."""
    gpus: int = 1
    """Ranks the step is data-parallel over (one sequence per rank); the figures are one rank's."""
    sp: int = 1
    """Ranks sharing each sequence (Ulysses sequence parallelism; divides `gpus`): each holds a shard of
    `seq_len_tokens`, and the step runs through `prepare(..., sequence_group=SequenceGroup(...))` (on the
    meta device `SequenceGroup.simulated(sp)`); 1: none."""
    shard: Shard = "none"
    """How each rank holds the model state (`SHARD_MODES`); more than one GPU needs a stage, and a stage
    on one GPU is one FSDP rank (what a single-GPU sharded run holds)."""
    stream: StreamConfig = StreamConfig()
    """What `prepare` gets: objective, partitions (streambp's partition and mst's MLP chunk are
    `partition_size`), attention kernel, streambp's LM head (the other methods have no such head and read
    recompute), offload (plain refuses it: `check_offload`). Resolved for a step: the baselines attend
    through the engine kernel when `baseline_attention` is auto (as on the meta device, so every method
    runs the same attention), and `baseline_loss` follows `protocol` (trl under trl, else full)."""

    def __post_init__(self) -> None:
        if not isinstance(self.model, str) or not self.model.strip():
            raise ConfigError(f"model must be a preset name or a directory, got {self.model!r}")
        check_method(self.method)
        if not isinstance(self.stream, StreamConfig):
            raise ConfigError(f"stream must be a StreamConfig, got {type(self.stream).__name__}")
        for name, choices in (("optimizer", OPTIMIZERS), ("dtype", DTYPES), ("protocol", PROTOCOLS),
                              ("grads", ("auto", *GRADS_MODES)), ("shard", SHARD_MODES)):
            require_choice(name, getattr(self, name), choices)
        check_offload(self.method, self.stream.offload, self.optimizer)
        for name in ("batch_size", "gpus", "sp"):
            require_positive(name, getattr(self, name))
        if self.sp > 1 and self.shard.startswith("deepspeed"):
            raise ConfigError(f"sp {self.sp} with shard {self.shard}: {SP_UNDER_DEEPSPEED}")
        if (problem := sequence_group_problem(self.sp, self.gpus)) is not None:
            raise ConfigError(problem)
        if self.gpus > 1 and self.shard == "none" and self.sp == 1:
            raise ConfigError(f"gpus {self.gpus} needs a shard stage (zero2, zero3, deepspeed-zero2/3): "
                              "replicated data parallelism holds on each GPU what one GPU holds")
        if not isinstance(self.seq_len_tokens, int) or isinstance(self.seq_len_tokens, bool) \
                or self.seq_len_tokens < 2:
            raise ConfigError(f"seq_len must be an integer >= 2, got {self.seq_len_tokens!r}")
        if self.seq_len_tokens < self.sp:
            raise ConfigError(f"seq_len {self.seq_len_tokens} is less than the {self.sp} sequence-parallel "
                              "ranks sharing it")
        if not isinstance(self.lora_rank, int) or isinstance(self.lora_rank, bool) or self.lora_rank < 0:
            raise ConfigError(f"lora rank must be 0 (off) or a positive integer, got {self.lora_rank!r}")
        self._check_training_step()
        self._resolve_stream()

    @classmethod
    def of(cls, **values: object) -> StepSpec:
        """A step from flat fields: the `StreamConfig` ones (objective, partition_size, head_mode, ...) make
        its `stream`, the rest are the step's own."""
        stream = {name: values.pop(name) for name in STREAM_FIELDS if name in values}
        return cls(**values, stream=StreamConfig(**stream))  # type: ignore[arg-type]

    def replaced(self, **changes: object) -> StepSpec:
        """This step with `changes`, flat fields as in `of` (stream fields change the stream)."""
        stream = {name: changes.pop(name) for name in STREAM_FIELDS if name in changes}
        if stream:
            changes["stream"] = replace(self.stream, **stream)
        return replace(self, **changes)  # type: ignore[arg-type]

    def to_dict(self) -> dict[str, object]:
        """Every field, flat (the stream's fields beside the step's; the tiers as their canonical string,
        so the dict is JSON's): what `of` takes back."""
        own = {f.name: getattr(self, f.name) for f in fields(self) if f.name != "stream"}
        stream = {name: getattr(self.stream, name) for name in STREAM_FIELDS}
        return {**own, **stream, "offload": str(self.stream.offload)}

    def _resolve_stream(self) -> None:
        """The step's stream: engine attention for the baselines (auto), the protocol's baseline loss, and
        recompute for the methods without a streamed head (as they ignore partitions)."""
        stream = self.stream
        resolved = replace(
            stream, baseline_loss="trl" if self.protocol == "trl" else "full",
            baseline_attention="engine" if stream.baseline_attention == "auto" else stream.baseline_attention,
            head_mode=stream.head_mode if self.method == "streambp" else "recompute")
        if resolved != stream:
            object.__setattr__(self, "stream", resolved)

    def _check_training_step(self) -> None:
        """Resolve grads; the paper protocol and resident grads belong to a backprop-only step."""
        if self.grads == "auto":
            object.__setattr__(self, "grads", "fresh" if self.optimizer != "none" else "resident")
        if self.optimizer != "none" and self.grads == "resident":
            raise ConfigError("grads resident with an optimizer: its step sets the gradients to None, so "
                              "the next step makes them (fresh)")
        if self.protocol == "paper" and self.is_training_step:
            raise ConfigError("protocol paper sizes the paper's backprop-only step; with an objective, "
                              "LoRA or an optimizer the step runs the default protocol")

    @property
    def objective(self) -> str:
        """The step's objective (`stream.objective`)."""
        return self.stream.objective

    @property
    def offload(self) -> Tiers:
        """The step's tiers in host memory (`stream.offload`)."""
        return self.stream.offload

    @property
    def is_training_step(self) -> bool:
        """Whether this is more than SFT backprop of full parameters (objective, LoRA or optimizer)."""
        return (self.objective, self.lora_rank, self.optimizer) != ("sft", 0, "none")

    @property
    def sequences(self) -> int:
        """Rows of the step's batch: 2 x batch_size for DPO (chosen + rejected), else batch_size."""
        return 2 * self.batch_size if self.objective == "dpo" else self.batch_size

    @property
    def partitioned(self) -> bool:
        """Whether the method takes partition sizes (`registry.Method.partitioned`); others ignore them."""
        return method_class(self.method).partitioned

    def at(self, seq_len_tokens: int) -> StepSpec:
        """This step at another length."""
        return replace(self, seq_len_tokens=seq_len_tokens)

    def describe(self) -> str:
        """The step in words, for a result's `how`."""
        lora = f"LoRA rank {self.lora_rank}" if self.lora_rank else "full parameters"
        return f"objective {self.objective}, {lora}, optimizer {self.optimizer}"
