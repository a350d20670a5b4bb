"""Frozen, validated configuration objects shared by the engine, the methods and the benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

METHODS = ("plain", "checkpoint", "mst", "streambp")
VERIFY_METHODS = ("checkpoint", "mst", "streambp")
"""The methods `verify` compares with plain when none are named."""
OBJECTIVES = ("sft", "grpo", "dpo")
ATTN_BACKENDS = ("auto", "sdpa", "flash")
BASELINE_ATTENTION = ("auto", "engine", "model")
PROTOCOLS = ("default", "paper")
"""Step protocols of a memory figure (see `streambp_core.measure.protocol`)."""
HEAD_MODES = ("auto", "fused", "recompute")
"""How streambp's LM head differentiates (see `streambp_core.engine.head`)."""
GRADS_MODES = ("resident", "fresh")
"""Whether parameter gradients exist before the step (resident) or are made by it (fresh)."""


class ConfigError(ValueError):
    """A user-facing configuration error; the CLI prints its message on one line."""


@dataclass(frozen=True, kw_only=True)
class StreamConfig:
    """How a prepared run splits its work along the sequence."""

    partition_size: int = 500
    """Tokens per query chunk in a decoder layer's streamed backward (and chunked no-grad forward)."""

    head_partition_size: int = 100
    """Tokens per chunk of the streamed LM head and loss."""

    head_mode: str = "recompute"
    """streambp's LM head: 'recompute' recomputes each chunk's logits in backward (least memory, every
    objective); 'fused' takes each chunk's gradients in the forward pass from the logits it already has
    (3 head GEMMs per chunk, not 4, and the logits' softmax once; costs one vocab x hidden gradient buffer
    from forward to backward; sft and grpo only); 'auto' fuses wherever the objective allows it."""

    mlp_chunk_size: int | None = None
    """Tokens per MLP chunk for Mini-Sequence Transformer; None means `partition_size`."""

    attn: str = "auto"
    """Attention kernel: 'flash' (flash-attn), 'sdpa' (torch), 'auto' (flash-attn if importable on CUDA)."""

    baseline_attention: str = "auto"
    """Attention of the transformers-driven methods (plain, checkpoint, mst): 'model' keeps the model's own
    implementation; 'engine' uses StreamBP's prefix-attention kernel (same kernel for every method, and no
    T x T mask, as the meta device needs); 'auto' is 'engine' on the meta device and 'model' elsewhere."""

    keep_chunks: int | None = None
    """Simulation only (meta device): every chunk loop runs just its first and last `keep_chunks` chunks.
    A chunk's memory depends only on its position, so the peak is unchanged while the step is not a
    real step; `prepare` refuses it on a model whose parameters are not on the meta device."""

    def __post_init__(self) -> None:
        require_choice("baseline_attention", self.baseline_attention, BASELINE_ATTENTION)
        if self.keep_chunks is not None:
            require_positive("keep_chunks", self.keep_chunks)
        for name in ("partition_size", "head_partition_size"):
            require_positive(name, getattr(self, name))
        if self.mlp_chunk_size is not None:
            require_positive("mlp_chunk_size", self.mlp_chunk_size)
        require_choice("attn", self.attn, ATTN_BACKENDS)
        require_choice("head_mode", self.head_mode, HEAD_MODES)

    @property
    def mlp_chunk_tokens(self) -> int:
        return self.mlp_chunk_size or self.partition_size


def require_choice(name: str, value: str, choices: tuple[str, ...]) -> None:
    """Raise ConfigError unless `value` is one of `choices` (the message lists them)."""
    if value not in choices:
        raise ConfigError(f"{name} must be one of {', '.join(choices)}, got {value!r}")


def require_positive(name: str, value: int) -> None:
    """Raise ConfigError unless `value` is a positive integer (bools are not integers here)."""
    if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
        raise ConfigError(f"{name} must be a positive integer, got {value!r}")


def check_method(method: str) -> str:
    """Return `method` if it names a known method, else raise ConfigError listing them."""
    if method not in METHODS:
        raise ConfigError(f"unknown method {method!r}; choose from {', '.join(METHODS)}")
    return method
