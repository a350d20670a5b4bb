"""Frozen, validated configuration objects shared by the engine, the methods and the benchmarks."""

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
    AttnBackend,
    Auto,
    BaselineAttention,
    BaselineLoss,
    Dtype,
    Grads,
    HeadMode,
    Method,
    Objective,
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
from streambp_core.tiers import OFFLOAD_MODES as TIER_SETS
from streambp_core.tiers import TierError, Tiers, tier_problem

OFFLOAD_MODES = TIER_SETS
"""Which parts of a step live in host memory: "none", or a canonical comma list of tiers (checkpoints,
optimizer, params; see `streambp_core.tiers`)."""
SOURCES = {"sim": "simulated", "cpu": "measured-cpu", "cuda": "measured-cuda"}
"""How a figure of a step run on each device was obtained, as every result row says."""


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How a prepared run splits its work along the sequence, and the objective its loss computes.

    Validated once, here: the choices, the sizes, and streambp's LM head resolved against the objective
    (auto -> fused where the objective allows it; fused refused where it does not)."""

    objective: Objective = "sft"
    """sft, grpo or dpo (see `streambp_core.engine.stream.objectives`)."""

    partition_size: int | Auto = 500
    """Tokens per query chunk in a decoder layer's streamed backward (and chunked no-grad forward); or
    AUTO (`choices.Auto`, resolved before a step runs)."""

    head_partition_size: int | Auto = 100
    """Tokens per chunk of the streamed LM head and loss; or AUTO (resolved before a step runs)."""

    head_mode: HeadMode = "recompute"
    """streambp's LM head: 'recompute' recomputes each chunk's logits in backward (least memory, every
    objective); 'fused' takes each chunk's gradients in the forward pass from the logits it already has
    (3 head GEMMs per chunk, not 4, and the logits' softmax once; costs one vocab x hidden gradient buffer
    from forward to backward; `FUSED_HEAD_OBJECTIVES` only); 'auto' fuses wherever the objective allows
    it, resolved here (the field then reads fused or recompute)."""

    mlp_chunk_size: int | None = None
    """Tokens per MLP chunk for Mini-Sequence Transformer; None means `partition_size`."""

    attn: AttnBackend = "auto"
    """Attention kernel: 'flash' (flash-attn), 'sdpa' (torch), 'auto' (flash-attn if importable on CUDA)."""

    attn_blocking: bool = True
    """streambp: a chunk whose prefix is longer than `engine.attention.blocked.BLOCKED_MIN_KEYS` keys runs
    its attention backward over tiles of keys on CUDA, so no kernel buffer grows with the prefix; False
    keeps the unblocked kernels at every length (to measure what blocking saves)."""

    baseline_attention: BaselineAttention = "auto"
    """Attention of the transformers-driven methods (plain, checkpoint, mst, and streambp through a
    family's own decoder layers, `methods.own_stream`): 'model' keeps the model's own implementation;
    'engine' uses StreamBP's prefix-attention kernel (same kernel for every method, and no T x T mask, as the
    meta device needs); 'auto' is 'engine' on the meta device and 'model' elsewhere."""

    keep_chunks: int | None = None
    """Simulation only (meta device): every chunk loop runs just its first and last `keep_chunks` chunks.
    A chunk's memory depends only on its position, so the peak is unchanged while the step is not a
    real step; `prepare` refuses it on a model whose parameters are not on the meta device."""

    baseline_loss: BaselineLoss = "full"
    """plain and checkpoint, GRPO and DPO: 'full' takes the objective from the logits of every position in
    at least float32 (`engine.stream.objectives`); 'trl' computes it as TRL 0.17's GRPOTrainer and DPOTrainer
    do (`methods.trl_loss`: GRPO's logits for the completion only, per-token log-probs row by row in the
    logits' dtype). The same loss either way; SFT and the streamed methods are unaffected."""

    offload: Tiers = Tiers.NONE
    """The tiers in host memory (`streambp_core.tiers`): a `Tiers`, or a comma list or a collection of
    tier names, stored as the `Tiers` it names (`Tiers.of`).
    checkpoints: what the method saves between forward and backward (layer inputs); checkpoint and mst
    through transformers' checkpoint offload, streambp through `engine.host.checkpoints.HostChain`. params:
    the weights, gathered a layer at a time (`engine.host.params`). optimizer: `Run.adamw()` gives the host
    optimizer (`engine.host.optimizer`). plain refuses checkpoints and params (`check_offload`)."""

    def __post_init__(self) -> None:
        object.__setattr__(self, "offload", offload_choice(self.offload))
        require_choice("objective", self.objective, OBJECTIVES)
        require_choice("baseline_attention", self.baseline_attention, BASELINE_ATTENTION)
        require_choice("baseline_loss", self.baseline_loss, BASELINE_LOSSES)
        if self.keep_chunks is not None:
            require_positive("keep_chunks", self.keep_chunks)
        for name in PARTITION_FIELDS:
            if getattr(self, name) == AUTO:
                object.__setattr__(self, name, AUTO)  # the text 'auto' too: the one Auto
            else:
                require_positive(name, getattr(self, name))
        if self.mlp_chunk_size is not None:
            require_positive("mlp_chunk_size", self.mlp_chunk_size)
        require_choice("attn", self.attn, ATTN_BACKENDS)
        require_choice("head_mode", self.head_mode, HEAD_MODES)
        self._resolve_head_mode()

    def _resolve_head_mode(self) -> None:
        """auto -> fused where the objective allows it, else recompute; fused refused where it does not."""
        fusable = self.objective in FUSED_HEAD_OBJECTIVES
        if self.head_mode == "fused" and not fusable:
            raise ConfigError(f"head_mode fused needs a loss linear in its per-sequence sums "
                              f"({', '.join(FUSED_HEAD_OBJECTIVES)}); {self.objective} takes 'recompute'")
        if self.head_mode == "auto":
            object.__setattr__(self, "head_mode", "fused" if fusable else "recompute")

    @property
    def mlp_chunk_tokens(self) -> int:
        return self.mlp_chunk_size or self.partition_size

    @property
    def automatic(self) -> tuple[str, ...]:
        """The partition fields that read AUTO (of `PARTITION_FIELDS`); empty when every size is given."""
        return tuple(name for name in PARTITION_FIELDS if getattr(self, name) == AUTO)


def require_sized(config: StreamConfig) -> None:
    """Raise ValueError when a partition of `config` still reads AUTO: a step runs sizes in tokens, and
    an automatic partition is resolved before (`step.search.partitions.resolve_partitions`), so one that gets
    here is a caller's mistake, not a user's."""
    if config.automatic:
        raise ValueError(f"{' and '.join(config.automatic)} {AUTO}: resolve the automatic partitions "
                         "before running a step (streambp_core.step.search.partitions.resolve_partitions)")


def check_offload(method: str, offload: Tiers, optimizer: str | None = None) -> None:
    """ConfigError when `method` cannot run with the tier set `offload` (and `optimizer`, when known):
    the one rule, `tiers.tier_problem` (plain keeps no checkpoints and streams no layers; params with an
    optimizer needs the optimizer tier; the optimizer tier needs an optimizer)."""
    if (problem := tier_problem(method, offload, optimizer)) is not None:
        raise ConfigError(problem)


def require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless `value` is one of `choices` (the message lists them)."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def offload_choice(value) -> Tiers:
    """The tier set `value` names (`Tiers.of`), or ConfigError naming the unknown tier."""
    try:
        return Tiers.of(value)
    except TierError as err:
        raise ConfigError(str(err)) from None


SP_UNDER_DEEPSPEED = ("sequence parallelism does not run under DeepSpeed ZeRO; its weights are whole on each "
                      "rank or sharded with FSDP2")
"""Why a step refuses sequence parallelism with a DeepSpeed shard stage (every command says it the same)."""


def packing_problem(objective: str, sp: int = 1) -> str | None:
    """Why packed rows (`--packing`) cannot run with `objective` on `sp` ranks per sequence, in one line;
    None when they can: packed rows train the sft objective on whole (unsplit) rows."""
    if objective != "sft":
        return f"--packing: packed rows train the sft objective, not {objective}"
    if sp > 1:
        return "--packing with sequence parallelism: packed rows run unsplit (without --sp)"
    return None


def require_positive(name: str, value: int) -> None:
    """Raise ConfigError unless `value` is a positive integer (bools are not integers here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_method(method: str) -> str:
    """Return `method` if it names a known method (`registry.method_class`), else raise ConfigError
    listing them."""
    try:
        method_class(method)
    except KeyError as err:
        raise ConfigError(err.args[0]) from None
    return method


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


STREAM_FIELDS = tuple(f.name for f in fields(StreamConfig))
"""The `StreamConfig` field names, which `StepSpec.of` and `replaced` route into the step's stream."""

