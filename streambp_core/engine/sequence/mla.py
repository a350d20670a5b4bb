"""One streamed multi-head latent attention layer (MLA: DeepSeek-V3) on this rank's shard of a
sequence-parallel sequence (Ulysses).

As `engine.stream.mla`, each chunk attends as multi-query attention against one key head per position, the
normed latent and the rotated k_rot (its values the same tensor), with kv_b_proj absorbed into the
queries (W_uk) and the outputs (W_uv); as `sequence.layer`, the chunks of every rank run in lockstep:
- forward (no grad): the shard's latent, gathered once into the whole sequence's (its one head copied to
  every rank: `kv_replication` of one KV head); then per chunk the absorbed queries go to head layout
  (this rank's H / size heads), attend to the latent of every position they see, and their latent-space
  outputs come back, each rank's heads up through its own W_uv rows after the swap back;
- backward: the latent gathered again; last chunk first, each chunk recomputed with grad and
  back-propagated, each rank block's latent prefix gradient added into one accumulator over the whole
  sequence (`layer._KVGradSink`, keys and values both into it); after the last chunk it goes back to this
  rank's positions, every rank's copy summed (one swap), then through each chunk's own kv_a_proj, kv_a
  norm and RoPE, and the input norm once on the sum of both shares.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from streambp_core.engine.chunks import backward_into, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.sequence.attention import (
    KV_PIECES,
    BlockAttention,
    SequenceBlocks,
    gathered_attention,
    lockstep_chunks,
)
from streambp_core.engine.sequence.group import heads_to_seq, seq_to_heads
from streambp_core.engine.sequence.layer import SequenceShard, ShardSteps, _KVGradSink
from streambp_core.engine.stream.kept import overwritable
from streambp_core.engine.stream.layer import (
    LayerPlan,
    _chunk_outputs,
    _output_grads,
    finish_chunk,
)
from streambp_core.engine.stream.mla import _latent_cache, _tables, mla_latent, mla_query
from streambp_core.measure.tags import memory_category


def _latent_attention(q, k, v, valid, *, plan: LayerPlan, blocks: SequenceBlocks, prefix=None) -> Tensor:
    """Per-head output (B, H, c, v_head_dim) of this rank's chunk of absorbed queries against the whole
    sequence's latent keys k (= v), over every rank's chunk `blocks`."""
    parts, mla = plan.parts, plan.parts.mla
    how = BlockAttention(parts.scaling, plan.attn, parts.sliding_window, plan.attn_blocking)
    out = gathered_attention(q, k, v, valid, blocks, how, prefix)
    w_uv = mla.kv_b_weight()[:, mla.nope_dim:]  # (H, v, r)
    return out[..., :mla.latent_dim] @ w_uv.transpose(1, 2)


def _chunk_plan(plan: LayerPlan, blocks: SequenceBlocks) -> LayerPlan:
    return replace(plan, attention=partial(_latent_attention, plan=plan, blocks=blocks))


def _whole_latent(plan: LayerPlan, shard: SequenceShard, h_in: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """The latent of the whole sequence (B, 1, T, kv_lora_rank + rope) on every rank, without grad."""
    parts = plan.parts
    latent = _latent_cache(plan, h_in)
    for start, end in chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks):
        x = parts.input_norm(h_in[:, start:end])
        latent[:, :, start:end] = mla_latent(parts.mla, x, *_tables(cos, sin, start, end))
    group = shard.group
    with torch.no_grad(), memory_category("kv"):
        whole = seq_to_heads(latent.transpose(1, 2), group, shard.total_tokens, copies=group.size,
                             pieces=KV_PIECES, thin=plan.thin)
    return whole.transpose(1, 2)


def mla_sequence_forward(plan: LayerPlan, shard: SequenceShard, h_in: Tensor, cos: Tensor, sin: Tensor,
                         key_valid: Tensor | None) -> Tensor:
    """Layer output of this rank's shard without grad, chunk by chunk in lockstep with every rank."""
    parts = plan.parts
    whole = _whole_latent(plan, shard, h_in, cos, sin)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
    for blocks in lockstep_chunks(shard.group, shard.total_tokens, plan.partition_size, plan.keep_chunks):
        start, end = blocks.mine
        h = h_in[:, start:end]
        q = mla_query(parts.mla, parts.input_norm(h), *_tables(cos, sin, start, end))
        h_out[:, start:end] = finish_chunk(_chunk_plan(plan, blocks), h, q, whole, whole, key_valid)
    return h_out


def mla_sequence_backward(plan: LayerPlan, shard: SequenceShard, h_in, cos, sin, key_valid, grad_out, params,
                          chunk_done=None) -> Tensor:
    """Accumulate the layer's weight gradients (this rank's tokens' share) and return dL/dH_in of the
    shard (module docstring)."""
    whole = _whole_latent(plan, shard, h_in, cos, sin)
    with memory_category("kv"):  # the whole sequence's latent gradient, laid out as heads_to_seq sends it
        d_whole = whole.new_zeros((whole.shape[0], whole.shape[2], 1, whole.shape[3]))
    grad_in = grad_out if plan.reuse_grad_out and overwritable(grad_out, h_in) else torch.empty_like(h_in)
    with memory_category("temporaries"):
        grad_normed = torch.empty_like(h_in)  # dL/d(input norm's output) through the queries
    for blocks in reversed(lockstep_chunks(shard.group, shard.total_tokens, plan.partition_size,
                                           plan.keep_chunks)):
        start, end = blocks.mine
        grad_in[:, start:end], grad_normed[:, start:end] = _query_chunk_backward(
            _chunk_plan(plan, blocks), h_in[:, start:end], _tables(cos, sin, start, end), key_valid,
            (whole, d_whole.transpose(1, 2)), grad_out[:, start:end], params)
    del whole
    with memory_category("kv"):
        d_latent = heads_to_seq(d_whole, shard.group, shard.total_tokens, copies=shard.group.size,
                                pieces=KV_PIECES, thin=plan.thin).transpose(1, 2)  # (B, 1, T_r, r + rope)
    del d_whole
    for start, end in reversed(chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks)):
        tables = _tables(cos, sin, start, end)
        grad_in[:, start:end] += _latent_chunk_backward(plan, h_in[:, start:end], tables,
                                                        d_latent[:, :, start:end], grad_normed[:, start:end],
                                                        params)
        if chunk_done is not None:
            chunk_done(start, end)
    return grad_in


def _query_chunk_backward(plan: LayerPlan, h_in_chunk, tables, key_valid, latent, grad_chunk, params):
    """Back-propagate the chunk's absorbed queries, attention over every rank's chunk, o_proj and MLP:
    returns its dL/dH_in through the residual and dL/dx of its normed input through the queries."""
    whole, d_whole = latent
    parts = plan.parts
    h = leaf(h_in_chunk)
    sink = _KVGradSink(d_whole, d_whole, [])
    plan = replace(plan, attention=partial(plan.attention, prefix=sink.prefix))
    with torch.enable_grad():
        x_leaf = leaf(parts.input_norm(h))
        q = mla_query(parts.mla, x_leaf, *tables)
        outputs = _chunk_outputs(plan, h, q, whole, whole, key_valid)
    grads = _output_grads(plan, outputs, grad_chunk)
    backward_into(outputs, grads, [h, x_leaf, *sink.leaves], params)
    del outputs, grads, q
    return grad_or_zeros(h), grad_or_zeros(x_leaf)


def _latent_chunk_backward(plan: LayerPlan, h_in_chunk, tables, d_latent, grad_normed, params) -> Tensor:
    """dL/dH_in of a chunk through its own latent (complete gradient `d_latent`) and the input norm, with
    the queries' share of the normed input's gradient, `grad_normed`."""
    parts = plan.parts
    h = leaf(h_in_chunk)
    with torch.enable_grad():
        x = parts.input_norm(h)
    x_leaf = leaf(x)
    with torch.enable_grad():
        own = mla_latent(parts.mla, x_leaf, *tables)
    backward_into([own], [d_latent], [x_leaf], params)
    backward_into([x], [grad_or_zeros(x_leaf).add_(grad_normed)], [h], params)
    return grad_or_zeros(h)


MLA_SEQUENCE_STEPS = ShardSteps(mla_sequence_forward, mla_sequence_backward)
"""An MLA layer's passes on a shard for `layer.SequenceStreamedLayer` (module docstring)."""
