"""One rank of a Ulysses sequence-parallel step, as the simulation runs it through the engine's code path.

A sequence-parallel step is simulated through the engine itself (`step.run.tracked.sequence_group`:
`prepare(..., sequence_group=SequenceGroup.simulated(sp))` on meta tensors): the rank embeds and runs
its shard of the whole batch (ceil(T/sp) tokens on rank 0, the longest), swaps to its H/sp heads over all
T tokens for attention, holds the head-sharded whole-sequence K/V (each KV head replicated when there
are fewer than sp, `engine.sequence.attention.kv_replication`), and its state is sharded over the `gpus`
ranks by `spec.shard` (the sp ranks are shard ranks too, as Arctic Long Sequence Training runs them).

Its all-to-alls run the real ones' code (`engine.sequence.group`) with the exchange itself skipped: the
same send and receive buffers and copies, allocated and freed at the same moments, so the step's tracked
peak is one real rank's, with nothing added after.

Also here: the rank's share of the optimizer's host state (`sharded_host`), and the bytes a rank sends
in a step's all-to-alls (`SequenceLayout.all_to_all_bytes`) for the step-time estimate.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec
from streambp_core.registry import method_class


def _heads(config: PretrainedConfig) -> tuple[int, int, int]:
    """(query heads, KV heads, head dim) of `config`."""
    heads = config.num_attention_heads
    kv = getattr(config, "num_key_value_heads", None) or heads
    return heads, kv, getattr(config, "head_dim", None) or config.hidden_size // heads


def check_sequence_parallel(spec: StepSpec, config: PretrainedConfig) -> None:
    """ConfigError (one line) unless `spec.sp` ranks can split `config`'s attention as the engine does: the
    query heads divide over them and the KV heads divide or are replicated to (`kv_replication`)."""
    if spec.sp == 1:
        return
    from streambp_core.engine.sequence.attention import kv_replication

    heads, kv, _ = _heads(config)
    try:
        kv_replication(heads, kv, spec.sp)
    except ConfigError as error:
        raise ConfigError(f"{spec.model}: {error}") from None


@dataclass(frozen=True, kw_only=True)
class SequenceLayout:
    """What one rank of `sp` holds of `sequences` rows of `total_tokens` on a model (in `element_bytes`)."""

    sp: int
    total_tokens: int
    sequences: int
    heads: int
    kv_heads: int
    head_dim: int
    element_bytes: int
    layers: int

    @classmethod
    def of(cls, spec: StepSpec, config: PretrainedConfig) -> SequenceLayout:
        """The layout of `spec` (its `sp`, length, rows, dtype) on `config`."""
        heads, kv, head_dim = _heads(config)
        element = {"float32": 4, "float64": 8}.get(spec.dtype, 2)
        return cls(sp=spec.sp, total_tokens=spec.seq_len_tokens, sequences=spec.sequences, heads=heads,
                   kv_heads=kv, head_dim=head_dim, element_bytes=element, layers=config.num_hidden_layers)

    @property
    def shard_tokens(self) -> int:
        """Tokens of the longest shard (rank 0's: the first T mod sp ranks hold one more)."""
        return math.ceil(self.total_tokens / self.sp)

    @property
    def kv_copies(self) -> int:
        """Copies of each KV head so that they split over the ranks (`kv_replication`; 1: none needed)."""
        return self.sp // math.gcd(self.kv_heads, self.sp)

    def q_bytes(self, tokens: int | None = None) -> int:
        """Queries (or outputs, or their gradients) of `tokens` of one rank (default: its shard)."""
        tokens = self.shard_tokens if tokens is None else tokens
        return self.sequences * tokens * self.heads * self.head_dim * self.element_bytes

    def kv_bytes(self) -> int:
        """Keys and values of the rank's shard as it swaps them (KV heads replicated as needed)."""
        return 2 * self.sequences * self.shard_tokens * self.kv_heads * self.kv_copies * self.head_dim \
            * self.element_bytes

    def all_to_all_bytes(self, method: str) -> int:
        """Bytes one rank sends in a step's all-to-alls: each pass over a layer's q, k, v and output, all but
        its own 1/sp share; a pass per attention pass of the method (`registry.Method.attention_passes`:
        forward and backward for plain; forward, recomputed forward and backward for checkpoint, mst and
        streambp, whose backward recomputes the layer's K/V and each chunk's queries from its checkpoint)."""
        per_pass = 2 * self.q_bytes() + self.kv_bytes()
        return method_class(method).attention_passes * self.layers * per_pass * (self.sp - 1) // self.sp

    def how(self) -> str:
        """The simulation of a rank, in words."""
        kv = f", each KV head replicated x{self.kv_copies}" if self.kv_copies > 1 else ""
        return (f"one rank of {self.sp} under Ulysses sequence parallelism: the engine's sequence-parallel "
                f"step on its {self.shard_tokens:,}-token shard{kv}, all-to-alls simulated with their send "
                "and receive buffers")


def sharded_host(host_bytes: tuple[int, int, int], spec: StepSpec, config: PretrainedConfig,
                 fraction: float) -> tuple[int, int, int]:
    """(host peak, bytes to host, bytes to device) of one rank of a sharded step with the optimizer tier:
    its `fraction` of the optimizer's host state (masters and moments), of the gradients it sends and of
    the updated weights it gets back, where the simulated one-GPU layout counts all of them. Without
    that tier, unchanged."""
    from streambp_core.step.parts.host_pool import host_resident_bytes

    if not spec.offload.optimizer or spec.optimizer == "none":
        return host_bytes
    state = host_resident_bytes(spec, config)["optimizer"]  # 3 float32 copies of the trainable weights
    weights = state // 6 if spec.dtype in ("bfloat16", "float16") else state // 3
    other = 1 - fraction
    peak, to_host, to_device = host_bytes
    return (peak - round(other * state), max(0, to_host - round(other * weights)),
            max(0, to_device - round(other * weights)))
