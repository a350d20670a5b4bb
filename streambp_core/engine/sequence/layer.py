"""One streamed decoder layer on this rank's shard of a sequence-parallel sequence (Ulysses).

As `engine.stream.layer`, but attention sees every rank's tokens (`engine.sequence.attention`):
- forward (no grad): K/V of the shard, gathered once into this rank's KV heads over the whole sequence
  (one swap of `KV_PIECES` all-to-alls), then the chunks of the shard in lockstep with every rank's
  (`lockstep_chunks`): the chunk's queries go to head layout and its outputs back (two all-to-alls per
  chunk);
- backward: the same K/V gathered again (one swap); then, last chunk first, each chunk recomputed with
  grad and back-propagated (its queries' and outputs' all-to-alls forward and backward: four per chunk),
  each rank block's K/V prefix gradient added, as soon as autograd makes it, into one dK/dV accumulator
  in head layout over the whole sequence (`_KVGradSink`); after the last chunk the gathered K/V are
  freed and the accumulator goes back to this rank's positions (one swap), then through its K/V
  projections and input norm, chunk by chunk.
Per layer and step: 3 K/V swaps of `KV_PIECES` all-to-alls each (fewer when a shard is shorter) plus 6
all-to-alls per chunk, whatever the sequence's padding or the ranks' shards.
Every rank block attends with the layer's soft-cap, its heads' sinks and, in a chunked local layer, the
chunks of the whole sequence (`sequence_attention.BlockAttention`); RoPE and a NoPE layer's query
temperature (Llama 4) take the shard's global positions.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, replace
from functools import partial
from typing import NamedTuple

import torch
from torch import Tensor

from streambp_core.engine import chunks
from streambp_core.engine.chunks import backward_into, check_accumulates, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.sequence.attention import (
    KV_PIECES,
    BlockAttention,
    SequenceBlocks,
    gather_kv,
    gathered_attention,
    kv_views,
    lockstep_chunks,
    scatter_kv_grads,
)
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.engine.stream.kept import keep_input, kept_input, overwritable
from streambp_core.engine.stream.layer import (
    LayerPlan,
    _chunk_outputs,
    _kv_by_hand,
    _kv_cache,
    _output_grads,
    finish_chunk,
    project_kv,
    project_q,
)
from streambp_core.engine.stream.linear_grads import kv_projection_backward
from streambp_core.engine.stream.rope import Rope
from streambp_core.measure.tags import memory_category


@dataclass(frozen=True)
class SequenceShard:
    """This rank's part of one step's sequence: the group, the whole sequence's length, KV head copies."""

    group: SequenceGroup
    total_tokens: int
    kv_copies: int = 1
    """Copies of each KV head so they split over the ranks (`sequence_attention.kv_replication`)."""

    @property
    def bounds(self) -> tuple[int, int]:
        """(start, end) global positions of this rank's shard."""
        return self.group.shard_bounds(self.total_tokens)


def _chunk_plan(plan: LayerPlan, blocks: SequenceBlocks, local: chunks.LocalChunks | None) -> LayerPlan:
    """`plan` attending over every rank's chunk `blocks` (the whole sequence's key mask as `valid`), with
    the layer's soft-cap, sinks and, in a chunked local layer, its chunks over the whole sequence
    (`local`)."""
    parts = plan.parts
    how = BlockAttention(parts.scaling, plan.attn, parts.sliding_window, plan.attn_blocking, parts.sinks,
                         parts.attn_softcap, local)
    return replace(plan, attention=partial(_blocks_attention, blocks=blocks, how=how))


def _blocks_attention(q, k, v, valid, *, blocks, how, prefix=None):
    return gathered_attention(q, k, v, valid, blocks, how, prefix)


def _whole_chunks(plan: LayerPlan, shard: SequenceShard, key_valid: Tensor | None,
                  h_in: Tensor) -> chunks.LocalChunks | None:
    """A chunked local layer's chunks over the whole sequence, numbered as the single-process layer numbers
    them (from each row's first real token); None in any other layer."""
    shape = (h_in.shape[0], shard.total_tokens)
    return chunks.local_chunks(plan.parts.attention_chunk, key_valid, None, shape, h_in.device)


@dataclass(frozen=True)
class _KVGradSink:
    """Each block's K/V prefix as fresh leaves whose gradients are added into the layer's accumulated dK,
    dV the moment autograd makes them, and freed: one block's at a time is alive, never a whole-sequence
    gradient per chunk (a leaf of the whole K/V, sliced per block, would collect one, zero-padded)."""

    d_keys: Tensor
    d_values: Tensor
    leaves: list

    def prefix(self, keys: Tensor, values: Tensor, first: int, last: int) -> tuple[Tensor, Tensor]:
        """Leaves of keys and values first..last - 1 (views), summing into the accumulators."""
        pair = []
        for tensor, target in ((keys, self.d_keys), (values, self.d_values)):
            prefix = leaf(tensor[:, :, first:last])
            prefix.register_post_accumulate_grad_hook(partial(_accumulate, target[:, :, first:last]))
            pair.append(prefix)
        self.leaves.extend(pair)
        return pair[0], pair[1]


def _accumulate(target: Tensor, prefix: Tensor) -> None:
    target.add_(prefix.grad)
    prefix.grad = None


def _gathered_kv(plan: LayerPlan, shard: SequenceShard, h_in: Tensor, rope: Rope):
    """K, V of this rank's heads over the whole sequence (no grad), and the shard's keys before a k-norm."""
    keys, values, raw_keys = _kv_cache(plan, h_in, rope)
    with torch.no_grad(), memory_category("kv"):
        keys, values = gather_kv(keys, values, shard.group, shard.total_tokens, shard.kv_copies, KV_PIECES,
                                 thin=plan.thin)
    return keys, values, raw_keys


def sequence_forward(plan: LayerPlan, shard: SequenceShard, h_in: Tensor, cos: Tensor, sin: Tensor,
                     key_valid: Tensor | None) -> Tensor:
    """Layer output of this rank's shard without grad, chunk by chunk in lockstep with every rank."""
    parts, rope = plan.parts, Rope.of_layer(cos, sin, plan.parts, offset=shard.bounds[0])
    keys, values, _ = _gathered_kv(plan, shard, h_in, rope)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
    local = _whole_chunks(plan, shard, key_valid, h_in)
    for blocks in lockstep_chunks(shard.group, shard.total_tokens, plan.partition_size, plan.keep_chunks):
        start, end = blocks.mine
        h = h_in[:, start:end]
        q = project_q(parts, parts.input_norm(h), rope.chunk(start, end))
        h_out[:, start:end] = finish_chunk(_chunk_plan(plan, blocks, local), h, q, keys, values, key_valid)
    return h_out


def sequence_backward(plan: LayerPlan, shard: SequenceShard, h_in, cos, sin, key_valid, grad_out, params,
                      chunk_done=None) -> Tensor:
    """Accumulate the layer's weight gradients (this rank's tokens' share) and return dL/dH_in of the
    shard (module docstring). `chunk_done(start, end)` as `layer.streamed_backward`'s."""
    rope = Rope.of_layer(cos, sin, plan.parts, offset=shard.bounds[0])
    keys, values, raw_keys = _gathered_kv(plan, shard, h_in, rope)
    with memory_category("kv"):  # dK and dV side by side, as `scatter_kv_grads` sends them
        b, heads, t, key_width = keys.shape
        d_kv = keys.new_zeros((b, t, heads, key_width + values.shape[-1]))
    grad_in = grad_out if plan.reuse_grad_out and overwritable(grad_out, h_in) else torch.empty_like(h_in)
    with memory_category("temporaries"):
        grad_normed = torch.empty_like(h_in)  # dL/d(input norm's output) through the queries, per position
    local = _whole_chunks(plan, shard, key_valid, h_in)
    for blocks in reversed(lockstep_chunks(shard.group, shard.total_tokens, plan.partition_size,
                                           plan.keep_chunks)):
        start, end = blocks.mine
        grad_in[:, start:end], grad_normed[:, start:end] = _query_chunk_backward(
            _chunk_plan(plan, blocks, local), h_in[:, start:end], rope.chunk(start, end), key_valid,
            (keys, values, d_kv), grad_out[:, start:end], params)
    del keys, values  # the gathered K/V: every chunk's attention is done
    with memory_category("kv"):
        d_keys, d_values = scatter_kv_grads(d_kv, key_width, shard.group, shard.total_tokens,
                                            shard.kv_copies, KV_PIECES, thin=plan.thin)
    del d_kv
    for start, end in reversed(chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks)):
        kv_grads = (d_keys[:, :, start:end], d_values[:, :, start:end],
                    None if raw_keys is None else raw_keys[:, start:end])
        grad_in[:, start:end] += _kv_chunk_backward(plan, h_in[:, start:end], rope.chunk(start, end),
                                                    kv_grads, grad_normed[:, start:end], params)
        if chunk_done is not None:
            chunk_done(start, end)
    return grad_in


def _query_chunk_backward(plan: LayerPlan, h_in_chunk, rope: Rope, key_valid, kv, grad_chunk, params):
    """Back-propagate the chunk's queries, attention over every rank's chunk, o_proj and MLP: returns its
    dL/dH_in through the residual, and dL/dx of its normed input x through the queries (the input norm's
    backward waits for the K/V share, so it runs once on the sum, as plain's autograd does: a norm that
    computes in float32 rounds its incoming gradient, so two partial backwards would not be exact)."""
    keys, values, d_kv = kv
    parts = plan.parts
    h = leaf(h_in_chunk)
    sink = _KVGradSink(*kv_views(d_kv, keys.shape[-1]), [])
    plan = replace(plan, attention=partial(plan.attention, prefix=sink.prefix))
    with torch.enable_grad():
        x_leaf = leaf(parts.input_norm(h))
        q = project_q(parts, x_leaf, rope)
        outputs = _chunk_outputs(plan, h, q, keys, values, key_valid)
    grads = _output_grads(plan, outputs, grad_chunk)
    backward_into(outputs, grads, [h, x_leaf, *sink.leaves], params)
    del outputs, grads, q
    return grad_or_zeros(h), grad_or_zeros(x_leaf)


def _kv_chunk_backward(plan: LayerPlan, h_in_chunk, rope: Rope, kv_grads, grad_normed, params) -> Tensor:
    """dL/dH_in of a chunk through its K/V projections and input norm, from its complete dK, dV and the
    queries' share of the normed input's gradient, `grad_normed`."""
    d_k, d_v, raw_keys = kv_grads
    parts = plan.parts
    h = leaf(h_in_chunk)
    with torch.enable_grad():
        x = parts.input_norm(h)
    x_leaf = leaf(x)
    if _kv_by_hand(parts):
        grad_x = kv_projection_backward(parts, x_leaf.detach(), raw_keys, d_k, d_v, rope, params)
    else:
        with torch.enable_grad():
            k, v, _ = project_kv(parts, x_leaf, rope)
        backward_into([k, v], [d_k, d_v], [x_leaf], params)
        grad_x = grad_or_zeros(x_leaf)
    backward_into([x], [grad_x.add_(grad_normed)], [h], params)
    return grad_or_zeros(h)


class ShardSteps(NamedTuple):
    """A streamed layer's two passes on a shard: `forward(plan, shard, h_in, cos, sin, key_valid)` -> h_out
    (no grad), `backward(plan, shard, h_in, cos, sin, key_valid, grad_out, params, chunk_done)` -> grad_in.
    `SEQUENCE_STEPS` is the decoder layer's; `sequence.mla.MLA_SEQUENCE_STEPS` an MLA layer's."""

    forward: Callable
    backward: Callable


class SequenceStreamedLayer(torch.autograd.Function):
    """`layer.StreamedLayer` on this rank's shard under sequence parallelism (module docstring), by the
    layer's `ShardSteps`."""

    @staticmethod
    def forward(ctx, h_in, cos, sin, key_valid, plan: LayerPlan, shard: SequenceShard, steps: ShardSteps,
                *params):
        ctx.plan, ctx.shard, ctx.steps, ctx.params = plan, shard, steps, params
        ctx.save_for_backward(keep_input(ctx, plan, h_in), cos, sin, key_valid)
        with torch.no_grad():
            return steps.forward(plan, shard, h_in, cos, sin, key_valid)

    @staticmethod
    def backward(ctx, grad_out):
        check_accumulates(ctx, "streambp's chunked decoder layer")
        saved, cos, sin, key_valid = ctx.saved_tensors
        h_in, chunk_done = kept_input(ctx, saved)
        grad_in = ctx.steps.backward(ctx.plan, ctx.shard, h_in, cos, sin, key_valid, grad_out, ctx.params,
                                     chunk_done)
        return (grad_in, None, None, None, None, None, None, *([None] * len(ctx.params)))


SEQUENCE_STEPS = ShardSteps(sequence_forward, sequence_backward)
"""The decoder layer's passes on a shard (`sequence_forward`, `sequence_backward`)."""
