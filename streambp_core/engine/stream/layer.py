"""StreamBP for one decoder layer: a no-grad chunked forward that keeps only the layer input, and a
backward that recomputes the layer chunk by chunk along the sequence (the StreamBP paper, arXiv 2506.03077).

Backward, per layer:
1. From the saved input H_in, compute K and V of the whole sequence once, without grad (B, Hkv, T, hd)
   (and, for a layer with a k-norm, the keys before it, B x T x kv_dim).
2. For each query chunk s..e, last chunk first: recompute norm and Q with grad; attend to the cached
   K(:e), V(:e) (views, no copy) lower-right causally; o_proj, residual, norm, MLP, residual;
   back-propagate dH_out(s:e) and add the attention's dK/dV of positions 0..e to the accumulated ones.
   Because chunks run last to first, those of positions s..e are then complete: back-propagate them
   through RoPE's transpose, the k-norm and the chunk's k/v projections (by hand for plain linear
   projections, `linear_grads.py`; recomputed with grad for wrapped ones), so the K/V projections are
   computed twice per position (forward and cache), as checkpointing does. Weight gradients accumulate
   in `.grad` (in place, by hand, for every plain linear projection: `linear_grads.hand_linear`).
Extra memory over the checkpoints: one chunk's activations plus O(T * kv_dim) for K, V and their grads.
A sliding-window (local) layer attends each chunk s..e to the keys of its band only, max(0, s - window + 1)
..e (views of the same caches), so its attention work per chunk is bounded by the window; a chunked local
layer (Llama 4's) to the keys from the earliest start of its queries' chunks, masked to each query's own
chunk (`chunks.LocalChunks`) where the band crosses a chunk boundary; a routed
(mixture-of-experts) layer under the load-balancing loss also returns its routing sums
(`engine.stream.router`).
A layer with attention sinks (gpt-oss) passes them to every chunk's attention: each query row's softmax
denominator takes its head's sink once, in the one chunk the row is in, and the sinks' gradient is the
sum of every recomputed chunk's share (`engine.attention.sinks`).
"""

from __future__ import annotations

from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import NamedTuple

import torch
from torch import Tensor

from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import (
    LocalChunks,
    backward_into,
    check_accumulates,
    chunk_bounds,
    grad_or_zeros,
    leaf,
    local_chunks,
    window_start,
)
from streambp_core.engine.host.checkpoints import HostChain
from streambp_core.engine.packing import PackedRows, query_rows
from streambp_core.engine.stream.kept import keep_input, kept_input, overwritable
from streambp_core.engine.stream.linear_grads import (
    down_projection_backward,
    gated_mlp,
    hand_linear,
    kv_projection_backward,
    mlp_inner,
    plain_linear,
)
from streambp_core.engine.stream.rope import Rope, rotate, scale_queries
from streambp_core.engine.stream.router import ChunkRouting, RouterAux
from streambp_core.measure.tags import memory_category
from streambp_core.models.adapters import LayerParts


@dataclass(frozen=True)
class LayerPlan:
    """What one streamed layer needs besides tensors: its modules, chunk size and attention kernel."""

    parts: LayerParts
    partition_size: int
    attn: str
    reuse_grad_out: bool = False
    """Write dL/dH_in over dL/dH_out in backward. Only for a caller that owns the layer's output: it feeds
    nothing but the next streamed layer or head (no hooks, no retained grads), as in `StreamBPRun`."""
    keep_chunks: int | None = None
    """Simulation only: run the first and last `keep_chunks` chunks of each loop (`StreamConfig`)."""
    offload: HostChain | None = None
    """Keep H_in in host memory between forward and backward, in this step's chain
    (`engine.host.checkpoints`)."""
    router_aux: RouterAux | None = None
    """A routed (mixture-of-experts) layer under the load-balancing loss: the layer also returns its
    routing sums (`engine.stream.router`)."""
    packed: PackedRows | None = None
    """This step's packed rows: each chunk attends within its queries' documents (`engine.packing`)."""
    attn_blocking: bool = True
    """Long prefixes attend through the blocked backward on CUDA (`StreamConfig.attn_blocking`)."""
    attention: Callable[[Tensor, Tensor, Tensor, Tensor | None], Tensor] | None = None
    """The chunk's attention (q, k, v, key mask) -> (B, H, c, hd) in place of `prefix_attention`: sequence
    parallelism's, over every rank's chunk (`engine.sequence.layer`); None: the chunk's own prefix."""

    @property
    def thin(self) -> bool:
        """Whether this is a thinned simulation (`keep_chunks` set): the K/V swaps run their end pieces
        only too (`sequence.group.seq_to_heads`'s `thin`)."""
        return self.keep_chunks is not None

    def routing(self, grad: Tensor | None = None) -> ChunkRouting | None:
        """A fresh `ChunkRouting` for one pass of a routed layer under the loss, else None."""
        if self.router_aux is None or self.parts.router is None:
            return None
        return ChunkRouting(self.parts.router, self.router_aux, grad)


def project_qkv(parts: LayerParts, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
    """Normed input x (B, c, d) -> rotated q (B, H, c, hd), rotated k and v (B, Hkv, c, hd)."""
    b, c, _ = x.shape
    k = hand_linear(parts.k_proj, x).view(b, c, parts.num_kv_heads, parts.head_dim)
    v = hand_linear(parts.v_proj, x).view(b, c, parts.num_kv_heads, parts.head_dim)
    return project_q(parts, x, rope), embed(parts, k, parts.k_norm, rope), v.transpose(1, 2)


def embed(parts: LayerParts, t: Tensor, norm, rope: Rope) -> Tensor:
    """Projected queries or keys t (B, c, heads, hd) -> (B, heads, c, hd), normed (when the layer has a
    q/k norm) and rotated, in the family's order (HunYuan norms after RoPE)."""
    if norm is None:
        return rotate(t.transpose(1, 2), rope)
    if parts.qk_norm_after_rope:
        return norm(rotate(t.transpose(1, 2), rope))
    return rotate(parts.norm_heads(norm, t).transpose(1, 2), rope)


def attend(plan: LayerPlan, h: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
    """The chunk's hidden states after attention and its residual (B, c, d), given its K/V prefix (or, in
    a sliding-window layer, at least the keys its band reaches)."""
    parts = plan.parts
    gate = None
    if isinstance(q, GatedQuery):
        q, gate = q
    if plan.attention is not None:
        attn = plan.attention(q, k, v, valid)
    else:
        attn = prefix_attention(q, k, v, valid, parts.scaling, plan.attn,  # (B, H, c, hd)
                                parts.sliding_window, blocking=plan.attn_blocking, sinks=parts.sinks,
                                softcap=parts.attn_softcap)
    b, heads, c, hd = attn.shape
    attn = attn.transpose(1, 2).reshape(b, c, heads * hd)
    attn = hand_linear(parts.o_proj, attn if gate is None else attn * torch.sigmoid(gate))
    return residual_add(parts, h, attn if parts.attn_out_norm is None else parts.attn_out_norm(attn))


def finish_chunk(plan: LayerPlan, h: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
    """Layer output for the chunk whose input is h (B, c, d), given its queries and its K/V prefix."""
    parts = plan.parts
    h = attend(plan, h, q, k, v, valid)
    mlp = parts.feed_forward(parts.post_norm(h))
    return residual_add(parts, h, mlp if parts.mlp_out_norm is None else parts.mlp_out_norm(mlp))


def residual_add(parts: LayerParts, h: Tensor, out: Tensor) -> Tensor:
    """h + out, out scaled first by the layer's residual multiplier (Granite), as transformers adds it."""
    return h + (out if parts.residual_multiplier == 1.0 else out * parts.residual_multiplier)


class GatedQuery(NamedTuple):
    """A gated attention's queries (B, H, c, hd) and output gate (B, c, H * hd) (Qwen3.5)."""

    q: Tensor
    gate: Tensor


def project_q(parts: LayerParts, x: Tensor, rope: Rope) -> Tensor | GatedQuery:
    """Normed input x (B, c, d) -> rotated q (B, H, c, hd) (scaled by a NoPE layer's temperature); for a
    gated attention (`attn_output_gate`) with its gate, split from each head's [query, gate] as
    transformers' Qwen3.5 attention splits it."""
    b, c, _ = x.shape
    if not parts.attn_output_gate:
        q = hand_linear(parts.q_proj, x).view(b, c, parts.num_heads, parts.head_dim)
        return scale_queries(embed(parts, q, parts.q_norm, rope), rope)
    q, gate = torch.chunk(hand_linear(parts.q_proj, x).unflatten(-1, (-1, 2 * parts.head_dim)), 2, dim=-1)
    return GatedQuery(scale_queries(embed(parts, q, parts.q_norm, rope), rope), gate.flatten(2))


def project_kv(parts: LayerParts, x: Tensor, rope: Rope) -> tuple[Tensor, Tensor, Tensor]:
    """Normed input x (B, c, d) -> rotated k, v (B, Hkv, c, hd) and k before its norm (B, c, Hkv, hd):
    projected, or for a norm after RoPE (HunYuan), rotated."""
    b, c, _ = x.shape
    raw_k = parts.k_proj(x).view(b, c, parts.num_kv_heads, parts.head_dim)
    v = parts.v_proj(x).view(b, c, parts.num_kv_heads, parts.head_dim)
    if parts.k_norm is not None and parts.qk_norm_after_rope:
        rotated = rotate(raw_k.transpose(1, 2), rope)
        return parts.k_norm(rotated), v.transpose(1, 2), rotated.transpose(1, 2)
    return embed(parts, raw_k, parts.k_norm, rope), v.transpose(1, 2), raw_k


def _valid(key_valid: Tensor | None, first: int, end: int) -> Tensor | None:
    return None if key_valid is None else key_valid[:, first:end]


def _chunk_keys(plan: LayerPlan, key_valid: Tensor | None, start: int, end: int,
                local: LocalChunks | None = None) -> tuple[int, Tensor | None]:
    """First key of the band chunk start..end attends to, and its key mask: (B, e) key validity, or for
    packed rows (B, c, e), each query's own document; in a chunked local layer (`local`) narrowed to each
    query's own chunk."""
    first = window_start(end, end - start, plan.parts.sliding_window)
    if local is not None:
        first = max(first, local.first_key(start))
    if plan.packed is None:
        valid = _valid(key_valid, first, end)
    else:
        first, valid = plan.packed.chunk_keys(start, end, first)
    return first, valid if local is None else local.narrow(valid, start, end, first)


def layer_chunks(plan: LayerPlan, key_valid: Tensor | None, h_in: Tensor) -> LocalChunks | None:
    """The local chunks of this step's rows in a chunked local layer (None in any other layer)."""
    positions = None if plan.packed is None else plan.packed.positions
    return local_chunks(plan.parts.attention_chunk, key_valid, positions, tuple(h_in.shape[:2]), h_in.device)


def _kv_cache(plan: LayerPlan, h_in: Tensor, rope: Rope):
    """Rotated K and V of the whole sequence (B, Hkv, T, hd), computed chunk by chunk, without grad, and
    the keys before the k-norm (B, T, Hkv, hd) when the backward takes a k-norm's gradient from them."""
    parts = plan.parts
    b, t, _ = h_in.shape
    shape = (b, parts.num_kv_heads, t, parts.head_dim)
    with memory_category("kv"):
        keys, values = h_in.new_empty(shape), h_in.new_empty(shape)
        keep_raw = _kv_by_hand(parts) and parts.k_norm is not None
        raw_keys = h_in.new_empty((b, t, parts.num_kv_heads, parts.head_dim)) if keep_raw else None
    for start, end in chunk_bounds(t, plan.partition_size, plan.keep_chunks):
        x = parts.input_norm(h_in[:, start:end])
        k, v, raw_k = project_kv(parts, x, rope.chunk(start, end))
        keys[:, :, start:end], values[:, :, start:end] = k, v
        if raw_keys is not None:
            raw_keys[:, start:end] = raw_k
    return keys, values, raw_keys


def _kv_by_hand(parts: LayerParts) -> bool:
    """Whether the K/V projections' backward is taken by hand (plain linear projections)."""
    return plain_linear(parts.k_proj) and plain_linear(parts.v_proj)


def _routed(routing: ChunkRouting | None, valid_rows: Tensor | None):
    return nullcontext() if routing is None else routing.chunk(valid_rows)


def streamed_forward(plan: LayerPlan, h_in: Tensor, cos: Tensor, sin: Tensor, key_valid: Tensor | None,
                     routing: ChunkRouting | None = None):
    """Layer output without grad, one query chunk at a time; K/V fill in as the chunks advance. With
    `routing`, each chunk's routing sums are added to it."""
    parts, rope = plan.parts, Rope.of_layer(cos, sin, plan.parts)
    b, t, _ = h_in.shape
    shape = (b, parts.num_kv_heads, t, parts.head_dim)
    with memory_category("kv"):
        keys, values = h_in.new_empty(shape), h_in.new_empty(shape)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
    local = layer_chunks(plan, key_valid, h_in)
    for start, end in chunk_bounds(t, plan.partition_size, plan.keep_chunks):
        h = h_in[:, start:end]
        q, k, v = project_qkv(parts, parts.input_norm(h), rope.chunk(start, end))
        keys[:, :, start:end], values[:, :, start:end] = k, v
        first, valid = _chunk_keys(plan, key_valid, start, end, local)
        with _routed(routing, _valid(key_valid, start, end)):
            h_out[:, start:end] = finish_chunk(plan, h, q, keys[:, :, first:end], values[:, :, first:end],
                                               valid)
    return h_out


def streamed_backward(plan, h_in, cos, sin, key_valid, grad_out, params,
                      chunk_done: Callable[[int, int], None] | None = None, routing=None) -> Tensor:
    """Accumulate the layer's weight gradients in `.grad` and return dL/dH_in (see module docstring).

    With `plan.reuse_grad_out`, dL/dH_in is written over dL/dH_out chunk by chunk (chunk s..e reads only
    its own slice of dL/dH_out, and chunks run last to first), so one (B, T, d) gradient is alive, not two.
    `chunk_done(start, end)` is called once chunk start..end no longer reads H_in (offload prefetch).
    """
    rope = Rope.of_layer(cos, sin, plan.parts)
    keys, values, raw_keys = _kv_cache(plan, h_in, rope)
    with memory_category("kv"):
        d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
    grad_in = grad_out if plan.reuse_grad_out and overwritable(grad_out, h_in) else torch.empty_like(h_in)
    local = layer_chunks(plan, key_valid, h_in)
    for start, end in reversed(chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks)):
        first, valid = _chunk_keys(plan, key_valid, start, end, local)
        band = slice(first, end)
        kv = _KVState(keys[:, :, band], values[:, :, band], d_keys[:, :, band], d_values[:, :, band],
                      None if raw_keys is None else raw_keys[:, start:end])
        chunk_grad = _chunk_backward(plan, h_in[:, start:end], rope.chunk(start, end),
                                     valid, kv, grad_out[:, start:end], params, routing)
        grad_in[:, start:end] = chunk_grad
        del kv, chunk_grad
        if chunk_done is not None:
            chunk_done(start, end)
    return grad_in


@dataclass(frozen=True)
class _KVState:
    """Views of one chunk's key/value prefix 0..e and of their accumulated gradients."""

    keys: Tensor
    values: Tensor
    d_keys: Tensor
    d_values: Tensor
    raw_keys: Tensor | None
    """The chunk's own keys before the k-norm (B, c, Hkv, hd), or None."""


def _chunk_backward(plan, h_in_chunk, rope: Rope, valid, kv: _KVState, grad_chunk, params, routing) -> Tensor:
    """Back-propagate one chunk; returns its dL/dH_in. Three passes, so the prefix needs no copy:
    1. the chunk's output against the cached K/V prefix (views, no concatenation) -> dQ path, o_proj, MLP,
       residual, and dK/dV of positions 0..e, added to the accumulated ones;
    2. the chunk's own k/v with their now complete dK/dV (see the module docstring);
    3. the input norm, with the normed input's gradient from passes 1 and 2.
    """
    parts = plan.parts
    by_hand = _kv_by_hand(parts)
    h = leaf(h_in_chunk)
    prefix_k, prefix_v = leaf(kv.keys), leaf(kv.values)
    with torch.enable_grad():
        x = parts.input_norm(h)
        x_leaf = leaf(x)
        if by_hand:
            q = project_q(parts, x_leaf, rope)
        else:
            q, k, v = project_qkv(parts, x_leaf, rope)
        with _routed(routing, query_rows(valid, h.shape[1])):
            outputs = _chunk_outputs(plan, h, q, prefix_k, prefix_v, valid)
    grads = _output_grads(plan, outputs, grad_chunk)
    if routing is not None:  # the load-balancing loss's share of this chunk
        outputs, grads = [*outputs, routing.term], [*grads, torch.ones_like(routing.term)]
    backward_into(outputs, grads, [h, x_leaf, prefix_k, prefix_v], params)
    del outputs, grads, q
    kv.d_keys.add_(grad_or_zeros(prefix_k))
    kv.d_values.add_(grad_or_zeros(prefix_v))
    del prefix_k, prefix_v  # their gradients, (B, Hkv, e, hd) each, before pass 2 allocates
    c = h.shape[1]
    d_k, d_v = kv.d_keys[:, :, -c:], kv.d_values[:, :, -c:]
    if by_hand:
        grad_x = grad_or_zeros(x_leaf)
        grad_x.add_(kv_projection_backward(parts, x_leaf.detach(), kv.raw_keys, d_k, d_v, rope, params))
    else:
        backward_into([k, v], [d_k, d_v], [x_leaf], params)
        grad_x = grad_or_zeros(x_leaf)
    backward_into([x], [grad_x], [h], params)
    return grad_or_zeros(h)


def _chunk_outputs(plan: LayerPlan, h, q, k, v, valid) -> list[Tensor]:
    """The chunk's recomputed graph ends: [output], or for a gated MLP taken by hand [the hidden states
    after attention, the down projection's input] (the down projection's forward is not needed)."""
    if not gated_mlp(plan.parts.mlp) or plan.parts.mlp_out_norm is not None:
        return [finish_chunk(plan, h, q, k, v, valid)]
    attended = attend(plan, h, q, k, v, valid)
    return [attended, mlp_inner(plan.parts.mlp, plan.parts.post_norm(attended))]


def _output_grads(plan: LayerPlan, outputs: list[Tensor], grad_chunk: Tensor) -> list[Tensor]:
    """Gradients for `_chunk_outputs`: dL/dout, or the residual's dL/dout and the down projection's input
    gradient (its weight gradient accumulates in `.grad` here)."""
    if len(outputs) == 1:
        return [grad_chunk]
    multiplier = plan.parts.residual_multiplier  # the MLP output's share of the residual (Granite)
    grad_mlp = grad_chunk if multiplier == 1.0 else grad_chunk * multiplier
    return [grad_chunk, down_projection_backward(plan.parts.mlp, outputs[1], grad_mlp)]


class LayerSteps(NamedTuple):
    """A streamed layer's two passes: `forward(plan, h_in, cos, sin, key_valid, routing)` -> h_out (no
    grad), and `backward(plan, h_in, cos, sin, key_valid, grad_out, params, chunk_done, routing)` ->
    grad_in (chunked recompute). `STREAMED` is the decoder layer's; `mla.MLA_STEPS` an MLA layer's."""

    forward: Callable
    backward: Callable


class StreamedLayer(torch.autograd.Function):
    """autograd.Function: forward = no-grad layer + keep H_in; backward = chunked recompute, by the
    layer's `LayerSteps` (`STREAMED` for every layer but an MLA one).

    The layer's trainable parameters are passed as inputs only so that the output requires grad (a LoRA
    model's frozen embedding would otherwise cut the graph); their gradients go straight into `.grad`.
    """

    @staticmethod
    def forward(ctx, h_in, cos, sin, key_valid, plan: LayerPlan, steps: LayerSteps, *params):
        ctx.plan, ctx.steps, ctx.params = plan, steps, params
        ctx.save_for_backward(keep_input(ctx, plan, h_in), cos, sin, key_valid)
        routing = plan.routing()
        with torch.no_grad():
            h_out = steps.forward(plan, h_in, cos, sin, key_valid, routing)
        if routing is None:
            return h_out
        ctx.mark_non_differentiable(routing.picks)
        return h_out, routing.prob_sum, routing.picks

    @staticmethod
    def backward(ctx, grad_out, *routing_grads):
        check_accumulates(ctx, "streambp's chunked decoder layer")
        saved, cos, sin, key_valid = ctx.saved_tensors
        h_in, chunk_done = kept_input(ctx, saved)
        routing_grad = routing_grads[0] if routing_grads else None
        routing = None if routing_grad is None else ctx.plan.routing(routing_grad)
        grad_in = ctx.steps.backward(ctx.plan, h_in, cos, sin, key_valid, grad_out, ctx.params, chunk_done,
                                     routing)
        return (grad_in, None, None, None, None, None, *([None] * len(ctx.params)))


STREAMED = LayerSteps(streamed_forward, streamed_backward)
"""The decoder layer's passes (`streamed_forward`, `streamed_backward`)."""
