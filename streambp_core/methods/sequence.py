"""Sequence parallelism (Ulysses) for every method: `prepare(model, method, sequence_group=group)`.

The contract, on every rank of the group:
- `run.loss(...)` takes the WHOLE batch (the same input_ids, attention_mask, labels and objective inputs
  on every rank: token ids and masks are a few bytes per token, against the activations that the shards
  divide). The run embeds and computes only this rank's contiguous shard (`SequenceGroup.shard_bounds`),
  at its global positions (RoPE); attention sees the whole sequence through all-to-alls
  (`engine.sequence.attention`).
- The objective is built on the whole batch, so labels shift globally before sharding (the last token of
  a shard predicts the first of the next) and every normaliser (SFT's count of valid tokens, GRPO's
  completion lengths, DPO's sequence log-probs) is the whole sequence's. Each rank streams its shard's
  token terms into per-sequence sums; the sums are added over the group (one all-reduce) before the
  objective's reduction, so every rank returns the whole sequence's loss.
- After `loss.backward()`, a rank's `.grad` holds its own tokens' share; the sum over the group is the
  gradient (`sequence_group.sum_gradients`). An engine that averages over its ranks (FSDP2, DeepSpeed)
  gives that sum divided by its world size: multiply the loss by the group's size there.

A trainer that calls the decoder stack itself (TRL's fused head) gives `Run.shard_batch` the whole batch
first; the stack then computes this rank's shard (`integrations.sequence_trainer`).

Per-family attention runs on the shards as it does in one process (`engine.sequence.attention`): Gemma 2's
soft-capped scores, gpt-oss's attention sinks (each rank its heads' slice), Llama 4's chunked local
attention (chunks counted over the whole sequence) and its NoPE layers' query temperature (at each token's
global index), and DeepSeek-V3's multi-head latent attention (streambp gathers the one latent key head to
every rank, `engine.sequence.mla`; the transformers-driven methods gather keys and values side by side at
their own head widths).

Refused by name: packed rows (position_ids), the params tier, DeepSpeed ZeRO, the router load-balancing
loss, TRL's baseline loss, Gated DeltaNet linear attention (Qwen3.5: its recurrence runs along the whole
sequence), and heads that cannot split over the ranks (`kv_replication`).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from streambp_core.config import ConfigError
from streambp_core.engine.sequence.attention import kv_replication
from streambp_core.engine.sequence.group import SequenceGroup, group_sum
from streambp_core.engine.sequence.layer import SequenceShard
from streambp_core.models.adapters import layer_parts


def check_sequence_run(run, group: SequenceGroup) -> int:
    """ConfigError for what sequence parallelism does not run; else the KV head copies it needs."""
    if not isinstance(group, SequenceGroup):
        raise ConfigError(f"sequence_group must be a SequenceGroup, got {type(group).__name__}")
    what = None
    if run.config.offload.params:
        what = "the params offload tier (weights in host memory)"
    elif run._reduction is not None:
        what = "DeepSpeed ZeRO"
    elif run.router_aux is not None:
        what = "the router load-balancing loss (output_router_logits)"
    elif run.config.baseline_loss == "trl" and run.objective_name != "sft":
        what = "baseline_loss trl (TRL's own GRPO/DPO loss over full logits)"
    elif any(layer_parts(layer).delta is not None for layer in run.parts.layers):
        what = "Gated DeltaNet linear attention (Qwen3.5: its recurrent state runs along the whole sequence)"
    if what is not None:
        raise ConfigError(f"sequence parallelism does not run with {what}")
    parts = layer_parts(run.parts.layers[0])
    return kv_replication(parts.num_heads, parts.num_kv_heads, group.size)


@dataclass(frozen=True, eq=False)
class StepShard:
    """One step's shard on this rank: the layers' view of it, the whole sequence's key validity (None:
    no padding) and this shard's global positions (1, T_r)."""

    shard: SequenceShard
    key_valid: Tensor | None
    positions: Tensor

    @property
    def bounds(self) -> tuple[int, int]:
        """(start, end) global positions of this rank's shard."""
        return self.shard.bounds


def step_shard(group: SequenceGroup, copies: int, input_ids: Tensor, key_valid: Tensor | None,
               position_ids: Tensor | None) -> StepShard:
    """This rank's shard of a whole batch (B, T); ConfigError for packed rows, T below the ranks, or a
    simulated group on real tensors (its all-to-alls move nothing: attention would read unfilled buffers)."""
    if position_ids is not None:
        raise ConfigError("sequence parallelism does not run packed rows (position_ids): each rank's shard "
                          "takes its global positions")
    total = input_ids.shape[1]
    if total < group.size:
        raise ConfigError(f"seq_len {total} is less than the {group.size} sequence-parallel ranks")
    if group.is_simulated and input_ids.device.type != "meta":
        device = input_ids.device.type
        raise ConfigError(f"a simulated sequence group runs on meta tensors only (got {device} input_ids): "
                          "its all-to-alls move nothing, so the loss would be read from unfilled buffers; "
                          "run real ranks with SequenceGroup.of_process_group (verify sp)")
    shard = SequenceShard(group=group, total_tokens=total, kv_copies=copies)
    start, end = shard.bounds
    positions = torch.arange(start, end, device=input_ids.device)[None]
    return StepShard(shard=shard, key_valid=key_valid, positions=positions)


@dataclass(frozen=True, eq=False)
class ShardObjective:
    """An objective built on the whole batch, as one rank streams it: its token terms at the shard's global
    positions (`offset`), its per-sequence sums added over the group before the reduction."""

    inner: object
    offset: int
    group: SequenceGroup

    @property
    def name(self) -> str:
        """The inner objective's name."""
        return self.inner.name

    @property
    def linear_reduce(self) -> bool:
        """Whether the inner reduction is linear (a sum over the group keeps it so)."""
        return self.inner.linear_reduce

    def logits_dtype(self, dtype: torch.dtype) -> torch.dtype:
        """The inner objective's logits precision."""
        return self.inner.logits_dtype(dtype)

    def token_terms(self, logits: Tensor, start: int, end: int) -> Tensor:
        """Token terms (B, c) of shard positions start..end."""
        return self.inner.token_terms(logits, start + self.offset, end + self.offset)

    def reduce(self, stats: Tensor) -> Tensor:
        """The loss of the whole sequence from this rank's per-sequence sums (B,)."""
        return self.inner.reduce(group_sum(stats, self.group))
