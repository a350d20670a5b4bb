"""Causal attention of a sequence whose tokens are sharded over a `SequenceGroup` (Ulysses).

Rank r holds the contiguous positions start_r..end_r of every sequence (`SequenceGroup.shard_bounds`). Keys
and values are gathered once (per layer) into head layout: this rank's KV heads over every position
(`gather_kv`, K and V together, in one all-to-all or, in streambp's layer, `KV_PIECES` of them). Queries
travel per block: every rank's block of queries (its whole shard, or its i-th chunk in streambp's lockstep
backward) goes `seq_to_heads`, so this rank holds its query heads of every rank's block; each rank's
sub-block attends to the keys 0..its last global position (views of the gathered keys, lower-right causal
as `prefix_attention` aligns), and the outputs go back with `heads_to_seq` (`gathered_attention`).

Per-head and per-position attention settings follow the layout (`BlockAttention`): a soft-cap (Gemma 2)
is elementwise on the scores; attention sinks (gpt-oss) are per query head, so each rank takes its heads'
slice; a chunked local layer's chunks (Llama 4) are counted over the whole sequence, so each rank block
attends to the keys from its queries' earliest chunk start, at their global positions.

GQA: the KV heads must split over the ranks as the query heads do. When they do not (fewer KV heads than
ranks, e.g. 8 KV heads on 16 ranks), each KV head is repeated `kv_replication` times first, as DeepSpeed's
Ulysses does (into the all-to-all's send buffer, never as a repeated tensor): query head h still meets the
keys of its own KV head, and the gradient of the copies sums back into it (`scatter_kv_grads`).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor

from streambp_core.config import ConfigError
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import LocalChunks
from streambp_core.engine.sequence.group import SequenceGroup, heads_to_seq, parts_to_heads, seq_to_heads


def kv_replication(num_heads: int, num_kv_heads: int, group_size: int) -> int:
    """How many copies of each KV head make the KV heads split over `group_size` ranks with the query
    heads (1: none needed); ConfigError when the query heads themselves do not split."""
    if num_heads % group_size:
        raise ConfigError(f"{num_heads} attention heads do not split over {group_size} sequence-parallel "
                          f"ranks (Ulysses gives each rank whole heads)")
    copies = group_size // math.gcd(num_kv_heads, group_size)
    if num_heads % (num_kv_heads * copies):
        raise ConfigError(f"{num_kv_heads} KV heads cannot be replicated to split over {group_size} "
                          f"sequence-parallel ranks with {num_heads} query heads")
    return copies


@dataclass(frozen=True)
class SequenceBlocks:
    """Each rank's block of query positions, in rank order: (start, end) local to the rank's shard."""

    group: SequenceGroup
    shard_starts: tuple[int, ...]
    """Global position of each rank's first token."""
    bounds: tuple[tuple[int, int], ...]

    @property
    def sizes(self) -> list[int]:
        """Each rank's block length (0 for a shard whose chunks have run out)."""
        return [end - start for start, end in self.bounds]

    @property
    def mine(self) -> tuple[int, int]:
        """This rank's block (local positions)."""
        return self.bounds[self.group.rank]


def shard_starts(group: SequenceGroup, total_tokens: int) -> tuple[int, ...]:
    """Global position of each rank's first token."""
    sizes = group.shard_sizes(total_tokens)
    return tuple(sum(sizes[:rank]) for rank in range(group.size))


def whole_shards(group: SequenceGroup, total_tokens: int) -> SequenceBlocks:
    """Every rank's whole shard as its block (the transformers-driven methods' attention)."""
    sizes = group.shard_sizes(total_tokens)
    return SequenceBlocks(group, shard_starts(group, total_tokens), tuple((0, size) for size in sizes))


def lockstep_chunks(group: SequenceGroup, total_tokens: int, partition_size: int,
                    keep_chunks: int | None = None) -> list[SequenceBlocks]:
    """Chunk i of every rank's shard, for each i, as many chunks on every rank (a shorter shard's last
    ones empty), so every rank runs the same collectives: a rank runs its empty chunk's all-to-alls and
    attends other ranks' blocks on its heads, so every layer op a chunk runs takes zero tokens (e.g. T 3
    over 2 ranks in chunks of 1: shards of 2 and 1, the second rank's last chunk empty). `keep_chunks`
    thins the chunk indices (the first and last that many) on every rank alike (simulation only,
    `StreamConfig.keep_chunks`)."""
    sizes = group.shard_sizes(total_tokens)
    starts = shard_starts(group, total_tokens)
    count = -(-max(sizes) // partition_size)
    indices = list(range(count))
    if keep_chunks is not None and count > 2 * keep_chunks:
        indices = indices[:keep_chunks] + indices[-keep_chunks:]
    return [SequenceBlocks(group, starts, tuple((min(i * partition_size, size),
                                                 min((i + 1) * partition_size, size)) for size in sizes))
            for i in indices]


KV_PIECES = 16
"""All-to-alls per whole-sequence K/V swap (`gather_kv`, `scatter_kv_grads`): each moves 1/16 of the
sequence, so its send and receive buffers are 1/16 of the gathered K/V (with KV heads replicated over many
ranks, one rank's K/V over the whole sequence: the layer's largest tensor). A fixed count per layer."""


def gather_kv(keys: Tensor, values: Tensor, group: SequenceGroup, total_tokens: int, copies: int,
              pieces: int = 1, thin: bool = False) -> tuple[Tensor, Tensor]:
    """This rank's K (B, Hkv, T_r, hd_k), V (B, Hkv, T_r, hd_v) -> this rank's KV heads over every position
    (B, Hkv', T, hd_k) and (B, Hkv', T, hd_v), Hkv' = Hkv x copies / size: views of one
    (B, T, Hkv', hd_k + hd_v) tensor (`kv_views`), swapped in `pieces` all-to-alls for both
    (`sequence_group.parts_to_heads`: no concatenated or repeated copy first). The value heads may be
    narrower or wider than the key heads (latent attention's). `thin`: simulation only (`seq_to_heads`).
    Differentiable."""
    kv = parts_to_heads([keys.transpose(1, 2), values.transpose(1, 2)], group, total_tokens, copies=copies,
                        pieces=pieces, thin=thin)
    return kv_views(kv, keys.shape[-1])


def kv_views(kv: Tensor, key_width: int) -> tuple[Tensor, Tensor]:
    """Keys (B, H, T, key_width) and values (B, H, T, the rest) as views of K and V side by side, `kv`
    (B, T, H, key_width + value width)."""
    return kv[..., :key_width].transpose(1, 2), kv[..., key_width:].transpose(1, 2)


def scatter_kv_grads(d_kv: Tensor, key_width: int, group: SequenceGroup, total_tokens: int, copies: int,
                     pieces: int = 1, thin: bool = False) -> tuple[Tensor, Tensor]:
    """The transpose of `gather_kv` for the accumulated gradients of K and V side by side, `d_kv`
    (B, T, Hkv', key_width + hd_v) -> this rank's dK (B, Hkv, T_r, key_width), dV (B, Hkv, T_r, hd_v), each
    KV head's copies summed; `pieces` all-to-alls, `thin` as `gather_kv`'s."""
    return kv_views(heads_to_seq(d_kv, group, total_tokens, copies=copies, pieces=pieces, thin=thin),
                    key_width)


KeyPrefix = Callable[[Tensor, Tensor, int, int], tuple[Tensor, Tensor]]
"""(keys, values, first, last) -> the keys and values of positions first..last - 1 that a block attends to."""


def _views(keys: Tensor, values: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
    return keys[:, :, first:last], values[:, :, first:last]


@dataclass(frozen=True)
class BlockAttention:
    """How every rank block of queries attends, besides its keys: `prefix_attention`'s settings, the layer's
    attention sinks over all its heads (each rank takes its heads' slice, `rank_sinks`) and a chunked local
    layer's chunks over the whole sequence (global positions)."""

    scale: float
    backend: str = "auto"
    window: int | None = None
    blocking: bool = True
    sinks: Tensor | None = None
    """Every query head's sink logit (H,) (gpt-oss), or None."""
    softcap: float | None = None
    """The scores' soft-cap (Gemma 2), or None."""
    local: LocalChunks | None = None
    """The chunks of a chunked local layer over the whole sequence (Llama 4's), or None."""


def rank_sinks(sinks: Tensor | None, group: SequenceGroup) -> Tensor | None:
    """This rank's query heads' slice of the sinks (H,): `seq_to_heads` gives rank r the heads
    r x H / size .. (r + 1) x H / size - 1 (KV heads are replicated, never query heads)."""
    if sinks is None:
        return None
    local = sinks.shape[0] // group.size
    return sinks[group.rank * local:(group.rank + 1) * local]


def _block_keys(how: BlockAttention, key_valid: Tensor | None, start: int, last: int):
    """First key of the block of global query positions start..last - 1, and its key mask: `key_valid`
    over first..last, in a chunked local layer narrowed to each query's own chunk."""
    if how.local is None:
        return 0, None if key_valid is None else key_valid[:, :last]
    first = how.local.first_key(start)
    valid = None if key_valid is None else key_valid[:, first:last]
    return first, how.local.narrow(valid, start, last, first)


def gathered_attention(q: Tensor, keys: Tensor, values: Tensor, key_valid: Tensor | None,
                       blocks: SequenceBlocks, how: BlockAttention,
                       prefix: KeyPrefix | None = None) -> Tensor:
    """Output (B, H, c, hd_v) of this rank's block of queries q (B, H, c, hd) against every position's keys
    of this rank's heads, `keys`/`values` (B, Hkv', >= last key, hd) from `gather_kv`. `key_valid` (B, T)
    marks real keys over the whole sequence (None: all). `prefix(keys, values, first, last)`: the K/V a
    block attends to (default: views). Two all-to-alls; differentiable."""
    prefix = prefix or _views
    group, sizes = blocks.group, blocks.sizes
    total = sum(sizes)
    heads = seq_to_heads(q.transpose(1, 2), group, total).transpose(1, 2)  # (B, H / size, total, hd)
    sinks = rank_sinks(how.sinks, group)
    outputs, offset = [], 0
    for rank, (start, end) in enumerate(blocks.bounds):
        if end > start:  # a rank whose shard has run out of chunks sends an empty block
            shard_start = blocks.shard_starts[rank]
            first, valid = _block_keys(how, key_valid, shard_start + start, shard_start + end)
            block_k, block_v = prefix(keys, values, first, shard_start + end)
            block = heads[:, :, offset:offset + end - start]
            outputs.append(prefix_attention(block, block_k, block_v, valid, how.scale, how.backend,
                                            how.window, how.blocking, sinks, how.softcap))
        offset += end - start
    out = torch.cat(outputs, dim=2).transpose(1, 2)  # (B, total, H / size, hd)
    return heads_to_seq(out, group, total).transpose(1, 2)
