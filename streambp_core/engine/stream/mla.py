"""StreamBP for a layer of multi-head latent attention (MLA: DeepSeek-V3), whose keys and values are one
compressed latent per position, shared by every head.

transformers' `DeepseekV3Attention`, per position: q = q_b_proj(q_a_layernorm(q_a_proj(x))) (or q_proj(x)),
split per head into q_nope and q_rot; kv_a_proj_with_mqa(x) = (latent of kv_lora_rank, k_rot of
qk_rope_head_dim); latent = kv_a_layernorm(latent); kv_b_proj(latent) = (k_nope, v) per head; q_rot and
the single k_rot are rotated (halves, or DeepSeek's `rope_interleave` pairs) and k_rot is broadcast to every
head; scores = (q_nope . k_nope + q_rot . k_rot) * scaling (YaRN's mscale folded in by transformers).

The engine keeps, per layer, only the latent and k_rot of the sequence, (B, 1, T, kv_lora_rank + rope), and
absorbs kv_b_proj into the chunk's queries and outputs: with W_uk, W_uv each head's rows of kv_b_proj,
q_nope . (W_uk c) = (W_uk^T q_nope) . c and softmax . (W_uv c) = W_uv (softmax . c). So each chunk attends
as multi-query attention with one key head, [latent, k_rot] (its values are the same tensor, whose first
kv_lora_rank features are the latent), and its output's latent part goes up through W_uv. The prefix K/V
and their gradients are thus the latent's size, not heads x (qk + v head dims); the layer's output equals
transformers' up to rounding (exact in float64 to ~1e-15). The chunk loop is `layer.py`'s otherwise: the
latent is computed once per backward without grad, each chunk's own latent is back-propagated once its
gradient is complete (chunks run last to first), and the MLP, residuals and routing are `layer.py`'s.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from functools import partial

import torch
from torch import Tensor

from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import backward_into, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.packing import query_rows
from streambp_core.engine.stream.kept import overwritable
from streambp_core.engine.stream.layer import (
    LayerPlan,
    LayerSteps,
    _chunk_keys,
    _chunk_outputs,
    _output_grads,
    _routed,
    _valid,
    finish_chunk,
)
from streambp_core.measure.tags import memory_category
from streambp_core.models.adapters import MlaParts


def rotate_mla(t: Tensor, cos: Tensor, sin: Tensor, interleave: bool) -> Tensor:
    """RoPE of t (B, heads, c, rd) with tables (B, 1, c, rd), bit for bit as transformers' DeepSeek-V3
    applies it: halves (`apply_rotary_pos_emb`), or with `rope_interleave` pairs (2i, 2i + 1) rotated and
    laid out as [evens, odds] (`apply_rotary_pos_emb_interleave`)."""
    if not interleave:
        half = t.shape[-1] // 2
        return t * cos + torch.cat((-t[..., half:], t[..., :half]), dim=-1) * sin
    half = cos.shape[-1] // 2
    cos, sin = cos[..., :half], sin[..., :half]
    t1, t2 = t[..., 0::2], t[..., 1::2]
    return torch.cat([t1 * cos - t2 * sin, t2 * cos + t1 * sin], dim=-1)


def mla_query(mla: MlaParts, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Normed input x (B, c, d) -> absorbed queries (B, H, c, kv_lora_rank + rope): W_uk^T q_nope, then the
    rotated q_rot."""
    b, c, _ = x.shape
    q = mla.q_proj(x) if mla.q_a_proj is None else mla.q_b_proj(mla.q_a_norm(mla.q_a_proj(x)))
    q = q.unflatten(-1, (-1, mla.nope_dim + mla.rope_dim)).transpose(1, 2)  # an empty chunk too
    q_nope, q_rot = torch.split(q, [mla.nope_dim, mla.rope_dim], dim=-1)
    w_uk = mla.kv_b_weight()[:, : mla.nope_dim]  # (H, nope, r)
    return torch.cat([q_nope @ w_uk, rotate_mla(q_rot, cos, sin, mla.rope_interleave)], dim=-1)


def mla_latent(mla: MlaParts, x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """Normed input x (B, c, d) -> the keys' one head (B, 1, c, kv_lora_rank + rope): the normed latent and
    the rotated k_rot."""
    b, c, _ = x.shape
    latent, k_rot = torch.split(mla.kv_a_proj(x), [mla.latent_dim, mla.rope_dim], dim=-1)
    latent = mla.kv_a_norm(latent).view(b, 1, c, mla.latent_dim)
    k_rot = rotate_mla(k_rot.view(b, 1, c, mla.rope_dim), cos, sin, mla.rope_interleave)
    return torch.cat([latent, k_rot], dim=-1)


def latent_attention(plan: LayerPlan, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
    """Per-head output (B, H, c, v_head_dim) of absorbed queries q against the latent keys k (= v)."""
    parts, mla = plan.parts, plan.parts.mla
    out = prefix_attention(q, k, v, valid, parts.scaling, plan.attn, parts.sliding_window,
                           blocking=plan.attn_blocking)
    w_uv = mla.kv_b_weight()[:, mla.nope_dim :]  # (H, v, r)
    return out[..., : mla.latent_dim] @ w_uv.transpose(1, 2)


def mla_plan(plan: LayerPlan) -> LayerPlan:
    """`plan` with the chunk's attention the latent one (`layer.attend` then runs o_proj and the rest)."""
    return replace(plan, attention=partial(latent_attention, plan))


def _tables(cos: Tensor, sin: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    return cos[:, None, start:end], sin[:, None, start:end]


def _latent_cache(plan: LayerPlan, h_in: Tensor) -> Tensor:
    mla = plan.parts.mla
    b, t, _ = h_in.shape
    with memory_category("kv"):
        return h_in.new_empty((b, 1, t, mla.latent_dim + mla.rope_dim))


def mla_forward(plan: LayerPlan, h_in: Tensor, cos: Tensor, sin: Tensor, key_valid: Tensor | None,
                routing=None) -> Tensor:
    """`layer.streamed_forward` of an MLA layer: the latent fills in as the chunks advance."""
    parts, chunked = plan.parts, mla_plan(plan)
    latent = _latent_cache(plan, h_in)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
    for start, end in chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks):
        h = h_in[:, start:end]
        x = parts.input_norm(h)
        c, s = _tables(cos, sin, start, end)
        latent[:, :, start:end] = mla_latent(parts.mla, x, c, s)
        q = mla_query(parts.mla, x, c, s)
        first, valid = _chunk_keys(plan, key_valid, start, end)
        keys = latent[:, :, first:end]
        with _routed(routing, _valid(key_valid, start, end)):
            h_out[:, start:end] = finish_chunk(chunked, h, q, keys, keys, valid)
    return h_out


def mla_backward(plan: LayerPlan, h_in, cos, sin, key_valid, grad_out, params,
                 chunk_done: Callable[[int, int], None] | None = None, routing=None) -> Tensor:
    """`layer.streamed_backward` of an MLA layer (module docstring)."""
    parts = plan.parts
    latent = _latent_cache(plan, h_in)
    bounds = chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks)
    for start, end in bounds:
        c, s = _tables(cos, sin, start, end)
        latent[:, :, start:end] = mla_latent(parts.mla, parts.input_norm(h_in[:, start:end]), c, s)
    with memory_category("kv"):
        d_latent = torch.zeros_like(latent)
    grad_in = grad_out if plan.reuse_grad_out and overwritable(grad_out, h_in) else torch.empty_like(h_in)
    chunked = mla_plan(plan)
    for start, end in reversed(bounds):
        first, valid = _chunk_keys(plan, key_valid, start, end)
        grad_in[:, start:end] = _chunk_backward(
            chunked, h_in[:, start:end], _tables(cos, sin, start, end), valid, latent[:, :, first:end],
            d_latent[:, :, first:end], grad_out[:, start:end], params, routing)
        if chunk_done is not None:
            chunk_done(start, end)
    return grad_in


def _chunk_backward(plan, h_in_chunk, tables, valid, keys, d_keys, grad_chunk, params, routing) -> Tensor:
    """One chunk: its output against the latent prefix (dQ, o_proj, MLP, the prefix's gradient added to
    the accumulated one), then its own latent with its now complete gradient, then the input norm."""
    parts = plan.parts
    h, prefix = leaf(h_in_chunk), leaf(keys)
    with torch.enable_grad():
        x = parts.input_norm(h)
        x_leaf = leaf(x)
        q = mla_query(parts.mla, x_leaf, *tables)
        own = mla_latent(parts.mla, x_leaf, *tables)
        with _routed(routing, query_rows(valid, h.shape[1])):
            outputs = _chunk_outputs(plan, h, q, prefix, prefix, valid)
    grads = _output_grads(plan, outputs, grad_chunk)
    if routing is not None:
        outputs, grads = [*outputs, routing.term], [*grads, torch.ones_like(routing.term)]
    backward_into(outputs, grads, [h, x_leaf, prefix], params)
    del outputs, grads, q
    d_keys.add_(grad_or_zeros(prefix))
    del prefix
    backward_into([own], [d_keys[:, :, -h.shape[1]:]], [x_leaf], params)
    backward_into([x], [grad_or_zeros(x_leaf)], [h], params)
    return grad_or_zeros(h)


MLA_STEPS = LayerSteps(mla_forward, mla_backward)
"""An MLA layer's passes for `layer.StreamedLayer`: chunked recompute against the latent (module
docstring)."""
