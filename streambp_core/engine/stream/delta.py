"""StreamBP for a Gated DeltaNet linear-attention layer (the `linear_attention` layers of Qwen3.5, dense and
MoE, and Qwen3-Next), whose token mixer is a recurrence rather than attention over a key/value prefix.

transformers' `Qwen3_5GatedDeltaNet`, per position t of the normed (and padding-masked) input x:
qkv = in_proj_qkv(x), z = in_proj_z(x), b = in_proj_b(x), a = in_proj_a(x) (Qwen3-Next: the same from
two fused projections, in_proj_qkvz and in_proj_ba, grouped per key head); a causal depthwise conv of
kernel K over qkv (its output at t reads the inputs t - K + 1..t), SiLU, split into q, k (l2-normed in the
rule) and v per head; beta = sigmoid(b), g = -exp(A_log) * softplus(a + dt_bias); the gated delta rule
S_t = exp(g_t) S_{t-1} + k_t (beta_t (v_t - S_{t-1}^T k_t))^T, o_t = S_t^T q_t / sqrt(dk), one state S
(dk x dv) per value head; then the gated RMSNorm norm(o) * silu(z) and out_proj.

So a chunk s..e of the sequence depends on everything before it only through two things: the state S at
s and the conv's halo, the K - 1 conv inputs before s. The engine keeps exactly these per chunk boundary
(O(heads * dk * dv) and O(K * conv_dim), whatever the length), besides the layer input:
1. Forward (no grad), chunks first to last: each chunk runs from its boundary's state and halo (zeros
   before the first chunk, as transformers starts) and leaves the next boundary's.
2. Backward, chunks last to first: recompute the chunk under autograd from its saved state and halo and
   back-propagate, at once, its output gradient, the gradient of its final state (carried from the chunk
   after it) and of the halo it hands on; this yields the gradients of its own initial state and halo,
   carried to the chunk before. The layer's weight gradients accumulate in `.grad` chunk by chunk.
The conv and the delta rule are transformers' own functions (`DeltaParts.conv`, `.chunk_rule`: the torch
path, or a kernel package where transformers dispatches to one), the conv run over [halo, chunk] and its
first K - 1 outputs dropped, the rule from the chunk's initial state with its final state returned; in a
float64 model both run under the module's at-least-float32 casts (`models.precision.delta_casts`). The
residuals, norms and MLP are `layer.py`'s (the down projection's backward by hand).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor
from torch.nn import functional as F

from streambp_core.engine.chunks import backward_into, check_accumulates, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.stream.kept import keep_input, kept_input, overwritable
from streambp_core.engine.stream.layer import (
    LayerPlan,
    _output_grads,
    residual_add,
)
from streambp_core.engine.stream.linear_grads import gated_mlp, hand_linear, mlp_inner
from streambp_core.measure.tags import memory_category
from streambp_core.models.adapters import DeltaParts
from streambp_core.models.precision import delta_casts


def delta_mix(delta: DeltaParts, x: Tensor, valid: Tensor | None, state: Tensor | None, halo: Tensor):
    """The linear attention's output for one chunk, as transformers' forward computes it.

    x: the chunk's normed input (B, c, d); valid: its (B, c) real tokens (None: no padding); state: the
    recurrent state (B, Hv, dk, dv) before the chunk (None: zeros, the sequence's start); halo: the conv
    inputs (B, conv_dim, K - 1) of the K - 1 positions before it. Returns the output (B, c, d), the
    state after the chunk and the halo of the chunk after it.
    """
    m = delta.module
    if valid is not None:  # transformers' apply_mask_to_padding_states
        x = (x * valid[:, :, None]).to(x.dtype)
    b, c, _ = x.shape
    with delta_casts(m):
        mixed, z, beta, a = _projections(m, x)
        beta = beta.sigmoid()
        window = torch.cat([halo, mixed], dim=-1)  # (B, conv_dim, K - 1 + c)
        conv = delta.conv(window, m.conv1d.weight.squeeze(1), m.conv1d.bias, activation=m.activation)
        conv = conv[:, :, delta.kernel_size - 1:].transpose(1, 2)  # (B, c, conv_dim)
        q, k, v = torch.split(conv, [m.key_dim, m.key_dim, m.value_dim], dim=-1)
        q, k = q.reshape(b, c, -1, m.head_k_dim), k.reshape(b, c, -1, m.head_k_dim)
        v = v.reshape(b, c, -1, m.head_v_dim)
        g = -m.A_log.float().exp() * F.softplus(a.float() + m.dt_bias)
        out, final = delta.chunk_rule(q, k, v, g=g, beta=beta, initial_state=state, output_final_state=True,
                                      use_qk_l2norm_in_kernel=True)
        out = m.norm(out.reshape(-1, m.head_v_dim), z.reshape(-1, m.head_v_dim)).reshape(b, c, -1)
        out = hand_linear(m.out_proj, out)
    return out, final, window[:, :, window.shape[-1] - (delta.kernel_size - 1):]


def _projections(m, x: Tensor) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The conv's input (B, conv_dim, c), z (B, c, Hv, dv), b and a (B, c, Hv) of the normed input x, as
    the module projects them: Qwen3.5's four projections, or Qwen3-Next's two fused ones, regrouped by
    its own `fix_query_key_value_ordering`."""
    b, c, _ = x.shape
    if not hasattr(m, "in_proj_qkvz"):
        z = hand_linear(m.in_proj_z, x).reshape(b, c, -1, m.head_v_dim)
        mixed = hand_linear(m.in_proj_qkv, x).transpose(1, 2)
        return mixed, z, hand_linear(m.in_proj_b, x), hand_linear(m.in_proj_a, x)
    q, k, v, z, beta, a = m.fix_query_key_value_ordering(hand_linear(m.in_proj_qkvz, x),
                                                          hand_linear(m.in_proj_ba, x))
    mixed = torch.cat([t.reshape(b, c, -1) for t in (q, k, v)], dim=-1).transpose(1, 2)
    return mixed, z, beta, a


def _chunk(plan: LayerPlan, h: Tensor, valid, state, halo, by_hand_mlp: bool):
    """The chunk's graph ends ([output], or [after the mixer's residual, the down projection's input] for
    a gated MLP taken by hand), its final state and the next halo."""
    parts = plan.parts
    mixed, final, next_halo = delta_mix(parts.delta, parts.input_norm(h), valid, state, halo)
    h = residual_add(parts, h, mixed)
    if by_hand_mlp:
        return [h, mlp_inner(parts.mlp, parts.post_norm(h))], final, next_halo
    return [residual_add(parts, h, parts.mlp(parts.post_norm(h)))], final, next_halo


def _by_hand_mlp(plan: LayerPlan) -> bool:
    return gated_mlp(plan.parts.mlp) and plan.parts.mlp_out_norm is None


def _valid(key_valid: Tensor | None, start: int, end: int) -> Tensor | None:
    return None if key_valid is None else key_valid[:, start:end]


def _zero_halo(delta: DeltaParts, h_in: Tensor) -> Tensor:
    return h_in.new_zeros((h_in.shape[0], delta.conv_dim, delta.kernel_size - 1))


def delta_forward(plan: LayerPlan, h_in: Tensor, key_valid: Tensor | None):
    """Layer output without grad, chunk by chunk, and each chunk's initial state and halo: (h_out, states
    (n - 1, B, Hv, dk, dv) for the chunks after the first, halos (n, B, conv_dim, K - 1)), n the chunks of
    the whole sequence (in a simulation that runs only some of them, `keep_chunks`, still every one's)."""
    parts, size = plan.parts, plan.partition_size
    count = _chunk_count(h_in, size)
    with memory_category("checkpoints"):
        h_out = torch.empty_like(h_in)
        halos = h_in.new_empty((count, *_zero_halo(parts.delta, h_in).shape))
    halos[0].zero_()
    state, states = None, None
    for start, end in chunk_bounds(h_in.shape[1], size, plan.keep_chunks):
        index = start // size
        if index > 0:
            states[index - 1] = state
        outputs, state, halo = _chunk(plan, h_in[:, start:end], _valid(key_valid, start, end), state,
                                      halos[index], False)
        h_out[:, start:end] = outputs[0]
        if index + 1 < count:
            halos[index + 1] = halo
        if states is None:
            with memory_category("checkpoints"):  # the boundaries' states: one per chunk after the first
                states = state.new_empty((count - 1, *state.shape))
    return h_out, states, halos


def _chunk_count(h_in: Tensor, size: int) -> int:
    return -(-h_in.shape[1] // size)


def delta_backward(plan: LayerPlan, h_in, key_valid, states, halos, grad_out, params,
                   chunk_done: Callable[[int, int], None] | None = None) -> Tensor:
    """Accumulate the layer's weight gradients in `.grad` and return dL/dH_in (module docstring, step 2);
    with `plan.reuse_grad_out` written over dL/dH_out chunk by chunk, as `layer.streamed_backward`."""
    grad_in = grad_out if plan.reuse_grad_out and overwritable(grad_out, h_in) else torch.empty_like(h_in)
    d_state = d_halo = None  # gradients of the final state and next halo of the chunk being taken
    for start, end in reversed(chunk_bounds(h_in.shape[1], plan.partition_size, plan.keep_chunks)):
        index = start // plan.partition_size
        state = None if index == 0 else states[index - 1]
        grad_in[:, start:end], d_state, d_halo = _chunk_backward(
            plan, h_in[:, start:end], _valid(key_valid, start, end), state, halos[index], index > 0,
            grad_out[:, start:end], d_state, d_halo, params)
        if chunk_done is not None:
            chunk_done(start, end)
    return grad_in


def _chunk_backward(plan, h_in_chunk, valid, state, halo, carries: bool, grad_chunk, d_state, d_halo,
                    params):
    """One chunk: its output, final state and next halo back-propagated together; returns its dL/dH_in
    and, when a chunk comes before it (`carries`), the gradients of its initial state and halo."""
    h = leaf(h_in_chunk)
    state = None if state is None else leaf(state)
    halo = leaf(halo) if carries else halo
    by_hand = _by_hand_mlp(plan)
    with torch.enable_grad():
        outputs, final, next_halo = _chunk(plan, h, valid, state, halo, by_hand)
    grads = _output_grads(plan, outputs, grad_chunk)
    if d_state is not None:
        outputs, grads = [*outputs, final, next_halo], [*grads, d_state, d_halo]
    backward_into(outputs, grads, [t for t in (h, state, halo) if t is not None], params)
    del outputs, grads, final, next_halo
    if not carries:
        return grad_or_zeros(h), None, None
    return grad_or_zeros(h), grad_or_zeros(state) if state is not None else None, grad_or_zeros(halo)


class DeltaStreamedLayer(torch.autograd.Function):
    """`layer.StreamedLayer` for a Gated DeltaNet layer: forward = no-grad layer, keeping H_in and each
    chunk boundary's state and halo; backward = chunked recompute last to first (module docstring)."""

    @staticmethod
    def forward(ctx, h_in, cos, sin, key_valid, plan: LayerPlan, *params):
        ctx.plan, ctx.params = plan, params
        kept = keep_input(ctx, plan, h_in)
        with torch.no_grad():
            h_out, states, halos = delta_forward(plan, h_in, key_valid)
        ctx.save_for_backward(kept, key_valid, states, halos)
        return h_out

    @staticmethod
    def backward(ctx, grad_out):
        check_accumulates(ctx, "streambp's chunked decoder layer")
        saved, key_valid, states, halos = ctx.saved_tensors
        h_in, chunk_done = kept_input(ctx, saved)
        grad_in = delta_backward(ctx.plan, h_in, key_valid, states, halos, grad_out, ctx.params, chunk_done)
        return (grad_in, None, None, None, None, *([None] * len(ctx.params)))
