"""One rank of a Ulysses sequence-parallel step, simulated: the rank's memory from a step of its shard.

Under Ulysses (`engine.sequence_group`) each of `sp` ranks holds T/sp tokens of every sequence; attention
swaps to this rank's H/sp heads over all T tokens by an all-to-all and back. Every tensor of a rank then
has the bytes of the same tensor in a one-GPU step of its T/sp tokens: the embedding, the MLP, the norms,
the checkpoints, the streamed head and loss scale with the tokens held; the head-sharded whole-sequence
queries, keys, values and outputs, (T, H/sp, hd), hold what (T/sp, H, hd) holds. So a rank is simulated
as the step of its shard (`simulate` at ceil(T/sp) tokens, the longest shard, its model state laid out
over `gpus` ranks as `spec.shard` holds it, the sp ranks being the shard ranks as ALST runs them), and
what a rank holds beyond that step is added at the peak, explicitly (`SequenceLayout.extra_bytes`):

- the all-to-all's transients: the sequence-layout copy of each tensor swapped to heads (the caller still
  holds it while the head-layout one is attended), and a send and a receive buffer of the largest one
  (q, or its gradient): for plain, checkpoint and mst, whose attention runs over the whole shard at
  once, q + k + v + 2 q of the shard; for streambp, whose layer backward swaps the whole-sequence K/V
  once per layer and then each chunk's queries and outputs, 3 (k + v) of the shard plus 3 q of a chunk;
- KV heads replicated when there are fewer than `sp` (each rank needs the KV head of its query heads, as
  DeepSpeed's Ulysses does): the rank's head-sharded K/V is `replication` times T/sp tokens' KV heads.
  streambp's per-layer K/V and their gradients (category kv) scale by it; the baselines hold a layer's
  replicated K/V for its attention's backward (every layer's for plain) in addition.
All are added at the step's peak as if it fell inside the largest all-to-all: an upper bound, stated.

This is an explicit account around a one-GPU step, not the engine's sequence-parallel code path on meta
tensors: `SimResult.how` says so. The host pool is one rank's too: its shard of the optimizer's host
state (`sharded_host`), its tokens' offloaded checkpoints.

The step time (`estimate_sequence_step`): the estimate of the shard's step with its attention scaled by
sp (H/sp heads over T queries and T keys: sp times the FLOPs of H heads over T/sp), plus the all-to-all
time (not overlapped: attention waits for it) and ZeRO's collectives beyond what compute hides, over the
interconnect of `INTERCONNECTS`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec

ATTENTION_PASSES = {"plain": 2, "checkpoint": 3, "mst": 3, "streambp": 3}
"""All-to-all passes over a layer's attention tensors per step: forward and backward (plain); forward,
recomputed forward and backward (checkpoint, mst; streambp's backward recomputes the layer's K/V and each
chunk's queries from its checkpoint)."""


def check_sequence_parallel(spec: StepSpec, config: PretrainedConfig) -> None:
    """ConfigError (one line) unless `spec.sp` ranks can split `config`'s attention: the query heads
    divide over them, and the KV heads either divide over them or are replicated (sp a multiple)."""
    sp = spec.sp
    if sp == 1:
        return
    heads, kv = config.num_attention_heads, getattr(config, "num_key_value_heads", None) or \
        config.num_attention_heads
    if heads % sp:
        raise ConfigError(f"sp {sp} does not divide {spec.model}'s {heads} query heads: Ulysses gives each "
                          "rank whole heads")
    if kv % sp and sp % kv:
        raise ConfigError(f"sp {sp} ranks cannot share {spec.model}'s {kv} KV heads: neither divides the "
                          "other, so they can be neither split nor replicated evenly")


@dataclass(frozen=True, kw_only=True)
class SequenceLayout:
    """What one rank of `sp` holds of a sequence of `total_tokens` on a model (bytes in `element_bytes`)."""

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
        heads = config.num_attention_heads
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
        return cls(sp=spec.sp, total_tokens=spec.seq_len_tokens, sequences=spec.sequences, heads=heads,
                   kv_heads=getattr(config, "num_key_value_heads", None) or heads, head_dim=head_dim,
                   element_bytes={"float32": 4, "float64": 8}.get(spec.dtype, 2),
                   layers=config.num_hidden_layers)

    @property
    def shard_tokens(self) -> int:
        """Tokens of the longest shard (rank 0's: the first T mod sp ranks hold one more)."""
        return math.ceil(self.total_tokens / self.sp)

    @property
    def replication(self) -> int:
        """How many times each KV head is held across the ranks (1 when they divide over them)."""
        return max(1, self.sp // self.kv_heads)

    def _bytes(self, tokens: int, heads: float) -> int:
        return round(self.sequences * tokens * heads * self.head_dim * self.element_bytes)

    def q_bytes(self, tokens: int | None = None) -> int:
        """Queries (or attention outputs, or their gradients) of `tokens` (default: the rank's shard)."""
        return self._bytes(self.shard_tokens if tokens is None else tokens, self.heads)

    def kv_bytes(self) -> int:
        """Keys and values the rank swaps per layer (its shard's, KV heads replicated as needed)."""
        return 2 * self._bytes(self.shard_tokens, self.kv_heads * self.replication)

    def extra_bytes(self, method: str, chunk_tokens: int, kv_category_bytes: int) -> dict[str, int]:
        """Bytes a rank holds beyond the one-GPU step of its shard at the peak (module docstring), by
        category: temporaries (all-to-all transients), kv (streambp's replicated K/V)."""
        replicated = self.kv_bytes() * (self.replication - 1) // self.replication
        if method == "streambp":
            chunk = min(chunk_tokens, self.shard_tokens)
            return {"temporaries": 3 * self.kv_bytes() + 3 * self.q_bytes(chunk),
                    "kv": kv_category_bytes * (self.replication - 1)}
        held = replicated * (self.layers if method == "plain" else 1)
        return {"temporaries": 3 * self.q_bytes() + self.kv_bytes() + held, "kv": 0}

    def all_to_all_bytes(self, method: str) -> int:
        """Bytes one rank sends in the step's all-to-alls: every pass over a layer's q, k, v and output,
        all but its own 1/sp share."""
        per_pass = 2 * self.q_bytes() + self.kv_bytes()
        return ATTENTION_PASSES[method] * self.layers * per_pass * (self.sp - 1) // self.sp

    def how(self) -> str:
        """The simulation's method in words."""
        kv = f"; KV heads replicated x{self.replication}" if self.replication > 1 else ""
        return (f"one rank of {self.sp} under Ulysses sequence parallelism: the step of its "
                f"{self.shard_tokens:,}-token shard plus the all-to-all buffers and head-sharded K/V "
                f"counted explicitly (step.sequence_layout){kv}")


def simulate_rank(spec: StepSpec, model, *, depth: str, keep_chunks: int | None):
    """One rank of `spec` (sp > 1) as a `simulate.SimResult`: the step of its shard (`shard_spec`), its
    breakdown with `with_extras` at the peak; the host figures the shard step's (one rank's already)."""
    from streambp_core.step.simulate import simulate

    config = model.config
    check_sequence_parallel(spec, config)
    shard = simulate(shard_spec(spec), model, depth=depth, keep_chunks=keep_chunks)
    breakdown = with_extras(shard.breakdown_bytes, spec, config)
    return replace(shard, spec=spec, peak_bytes=sum(breakdown.values()), breakdown_bytes=breakdown,
                   note=SequenceLayout.of(spec, config).how())


def shard_spec(spec: StepSpec) -> StepSpec:
    """The one-GPU-shaped step whose memory a rank of `spec` holds: its shard's tokens, no sp."""
    return replace(spec, sp=1, seq_len_tokens=max(2, math.ceil(spec.seq_len_tokens / spec.sp)))


def with_extras(breakdown_bytes: dict[str, int], spec: StepSpec, config: PretrainedConfig
                ) -> dict[str, int]:
    """A rank's breakdown: the shard step's at its peak plus `SequenceLayout.extra_bytes`."""
    layout = SequenceLayout.of(spec, config)
    extra = layout.extra_bytes(spec.method, spec.stream.partition_size, breakdown_bytes.get("kv", 0))
    return {name: value + extra.get(name, 0) for name, value in breakdown_bytes.items()}


def sharded_host(host_bytes: tuple[int, int, int], spec: StepSpec, config: PretrainedConfig,
                 fraction: float) -> tuple[int, int, int]:
    """(host peak, bytes to host, bytes to device) of one rank of a sharded step with the optimizer tier:
    the rank's `fraction` of the optimizer's host state (masters and moments), of the gradients sent and
    of the updated weights returned, where the one-GPU step counts all of them. Without it, unchanged."""
    from streambp_core.step.host_pool import host_resident_bytes
    from streambp_core.tiers import offload_tiers

    if "optimizer" not in offload_tiers(spec.offload) or spec.optimizer == "none":
        return host_bytes
    state = host_resident_bytes(spec, config)["optimizer"]
    trainable = state // 6 if spec.dtype in ("bfloat16", "float16") else state // 3  # one copy of the weights
    other = 1 - fraction
    peak, to_host, to_device = host_bytes
    return (peak - round(other * state), max(0, to_host - round(other * trainable)),
            max(0, to_device - round(other * trainable)))
