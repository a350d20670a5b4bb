"""StreamBP for one decoder layer: a no-grad chunked forward that keeps only the layer input, and a
backward that recomputes the layer chunk by chunk along the sequence (PAPER.md section 1).

Backward, per layer:
1. From the saved input H_in, compute K and V of the whole sequence once, without grad (B, Hkv, T, hd).
2. For each query chunk s..e, last chunk first: recompute norm, Q, and the chunk's own k/v with grad;
   attend to [K(:s), k(s:e)] lower-right causally; o_proj, residual, norm, MLP, residual; back-propagate
   dH_out(s:e) together with the dK/dV that later chunks have accumulated for positions s..e. Because
   chunks run last to first, those are complete, so the K/V projections are differentiated once per
   position. Weight gradients accumulate in `.grad`; dK/dV of the prefix accumulate for earlier chunks.
Extra memory over the checkpoints: one chunk's activations plus O(T * kv_dim) for K, V and their grads.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from streambp_core.engine.attention import prefix_attention
from streambp_core.engine.chunks import backward_into, chunk_bounds, grad_or_zeros, leaf
from streambp_core.measure.tags import memory_category
from streambp_core.models.adapters import LayerParts


@dataclass(frozen=True)
class LayerPlan:
    """What one streamed layer needs besides tensors: its modules, chunk size and attention kernel."""

    parts: LayerParts
    partition_size: int
    attn: str


def project_qkv(parts: LayerParts, x: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """Normed input x (B, c, d) -> rotated q (B, H, c, hd), rotated k and v (B, Hkv, c, hd)."""
    b, c, _ = x.shape
    q = parts.q_proj(x).view(b, c, parts.num_heads, parts.head_dim)
    k = parts.k_proj(x).view(b, c, parts.num_kv_heads, parts.head_dim)
    v = parts.v_proj(x).view(b, c, parts.num_kv_heads, parts.head_dim)
    if parts.q_norm is not None:
        q, k = parts.q_norm(q), parts.k_norm(k)
    q, k = apply_rotary_pos_emb(q.transpose(1, 2), k.transpose(1, 2), cos, sin)
    return q, k, v.transpose(1, 2)


def finish_chunk(plan: LayerPlan, h: Tensor, q: Tensor, k: Tensor, v: Tensor, valid: Tensor | None) -> Tensor:
    """Layer output for the chunk whose input is h (B, c, d), given its queries and its K/V prefix."""
    parts = plan.parts
    attn = prefix_attention(q, k, v, valid, parts.scaling, plan.attn)  # (B, H, c, hd)
    attn = attn.transpose(1, 2).reshape(h.shape[0], h.shape[1], -1)
    h = h + parts.o_proj(attn)
    return h + parts.mlp(parts.post_norm(h))


def _rope(cos: Tensor, sin: Tensor, start: int, end: int) -> tuple[Tensor, Tensor]:
    return cos[:, start:end], sin[:, start:end]


def _valid(key_valid: Tensor | None, end: int) -> Tensor | None:
    return None if key_valid is None else key_valid[:, :end]


def _kv_cache(plan: LayerPlan, h_in: Tensor, cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:
    """Rotated K and V of the whole sequence (B, Hkv, T, hd), computed chunk by chunk, without grad."""
    parts = plan.parts
    b, t, _ = h_in.shape
    shape = (b, parts.num_kv_heads, t, parts.head_dim)
    with memory_category("kv"):
        keys, values = h_in.new_empty(shape), h_in.new_empty(shape)
    for start, end in chunk_bounds(t, plan.partition_size):
        x = parts.input_norm(h_in[:, start:end])
        _, k, v = project_qkv(parts, x, *_rope(cos, sin, start, end))
        keys[:, :, start:end], values[:, :, start:end] = k, v
    return keys, values


def streamed_forward(plan: LayerPlan, h_in: Tensor, cos: Tensor, sin: Tensor, key_valid: Tensor | None):
    """Layer output without grad, one query chunk at a time; K/V fill in as the chunks advance."""
    parts = plan.parts
    b, t, _ = h_in.shape
    shape = (b, parts.num_kv_heads, t, parts.head_dim)
    with memory_category("kv"):
        keys, values = h_in.new_empty(shape), h_in.new_empty(shape)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
    for start, end in chunk_bounds(t, plan.partition_size):
        h = h_in[:, start:end]
        q, k, v = project_qkv(parts, parts.input_norm(h), *_rope(cos, sin, start, end))
        keys[:, :, start:end], values[:, :, start:end] = k, v
        h_out[:, start:end] = finish_chunk(plan, h, q, keys[:, :, :end], values[:, :, :end],
                                           _valid(key_valid, end))
    return h_out


def streamed_backward(plan, h_in, cos, sin, key_valid, grad_out, params) -> Tensor:
    """Accumulate the layer's weight gradients in `.grad` and return dL/dH_in (see module docstring)."""
    keys, values = _kv_cache(plan, h_in, cos, sin)
    with memory_category("kv"):
        d_keys, d_values = torch.zeros_like(keys), torch.zeros_like(values)
    grad_in = torch.empty_like(h_in)
    for start, end in reversed(chunk_bounds(h_in.shape[1], plan.partition_size)):
        h = leaf(h_in[:, start:end])
        prefix_k, prefix_v = leaf(keys[:, :, :start]), leaf(values[:, :, :start])
        with torch.enable_grad():
            q, k, v = project_qkv(plan.parts, plan.parts.input_norm(h), *_rope(cos, sin, start, end))
            all_k, all_v = torch.cat([prefix_k, k], dim=2), torch.cat([prefix_v, v], dim=2)
            out = finish_chunk(plan, h, q, all_k, all_v, _valid(key_valid, end))
        backward_into(
            [out, k, v],
            [grad_out[:, start:end], d_keys[:, :, start:end], d_values[:, :, start:end]],
            [h, prefix_k, prefix_v],
            params,
        )
        grad_in[:, start:end] = grad_or_zeros(h)
        if start > 0:
            d_keys[:, :, :start] += grad_or_zeros(prefix_k)
            d_values[:, :, :start] += grad_or_zeros(prefix_v)
        del q, k, v, all_k, all_v, out  # before the next chunk allocates its own
    return grad_in


class StreamedLayer(torch.autograd.Function):
    """autograd.Function: forward = no-grad layer + keep H_in; backward = chunked recompute.

    The layer's trainable parameters are passed as inputs only so that the output requires grad (a LoRA
    model's frozen embedding would otherwise cut the graph); their gradients go straight into `.grad`.
    """

    @staticmethod
    def forward(ctx, h_in, cos, sin, key_valid, plan: LayerPlan, *params):
        ctx.plan, ctx.params = plan, params
        ctx.save_for_backward(h_in, cos, sin, key_valid)
        with torch.no_grad():
            return streamed_forward(plan, h_in, cos, sin, key_valid)

    @staticmethod
    def backward(ctx, grad_out):
        h_in, cos, sin, key_valid = ctx.saved_tensors
        grad_in = streamed_backward(ctx.plan, h_in, cos, sin, key_valid, grad_out, ctx.params)
        return (grad_in, None, None, None, None, *([None] * len(ctx.params)))
