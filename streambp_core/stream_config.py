"""How a prepared run splits its work along the sequence, and the objective its loss computes:
`StreamConfig`, the engine's settings of one step (a `StepSpec`'s `stream`)."""

from __future__ import annotations

from dataclasses import dataclass, fields

from streambp_core.choices import (
    ATTN_BACKENDS,
    AUTO,
    BASELINE_ATTENTION,
    BASELINE_LOSSES,
    FUSED_HEAD_OBJECTIVES,
    HEAD_MODES,
    OBJECTIVES,
    PARTITION_FIELDS,
    AttnBackend,
    Auto,
    BaselineAttention,
    BaselineLoss,
    HeadMode,
    Objective,
)
from streambp_core.errors import ConfigError
from streambp_core.rules import offload_choice, require_choice, require_positive
from streambp_core.tiers import Tiers


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


STREAM_FIELDS = tuple(f.name for f in fields(StreamConfig))
"""The `StreamConfig` field names, which `StepSpec.of` and `replaced` route into the step's stream."""
