"""Causal attention of a query chunk against its key/value prefix, aligned lower-right.

The queries of a chunk are the last `c` positions of the `e` keys they see, so query row i may attend to
keys 0 .. e - c + i (flash-attn's `causal=True`; SDPA's `causal_lower_right`, never `is_causal`, which aligns
top-left). With a sliding window the allowed keys narrow to the lower-right band: query row i sees keys
e - c + i - window + 1 .. e - c + i. Keys and values stay at the KV-head count (GQA/MQA) throughout.
With a logit soft-cap (Gemma 2's `attn_logit_softcapping`) the scaled scores s become cap * tanh(s / cap)
before the mask and the softmax, as transformers' eager attention computes them; their backward multiplies
each score's gradient by 1 - tanh(s / cap)^2.

Kernels:
- CUDA: `cuda_attention.py`: flash-attn when importable and chosen (varlen for a padded batch), otherwise
  SDPA (the lower-right bias keeps its flash kernel; a padded batch needs a boolean mask). SDPA and
  torch's own flash kernel have no soft-cap: a soft-capped chunk that flash-attn does not take runs the
  custom ops below on the GPU (exact, with the chunk's score matrix; `plan_kernel`'s 'softcap-math').
- CPU and meta: the `streambp::prefix_attn_fwd/_bwd` custom ops. Their CPU kernels are exact math in the
  input precision (float64 stays float64); their fake kernels allocate what a flash kernel allocates (the
  output and a float32 log-sum-exp, never a score matrix), so a simulated step on the meta device sees the
  memory a GPU step would. On meta the backward also holds, while it runs, the buffers the CUDA path
  this chunk would take allocates inside its kernels (`cuda_attention.plan_kernel`,
  `kernel_workspace.py`), filed under the `kernel_workspace` category.

Attention sinks (gpt-oss): one learned logit per query head, `sinks` (H,), joins every query row's softmax
denominator and attends to nothing: p_j = exp(s_j - L), L = log(exp(sink) + sum_j exp(s_j)). The ops
return that L; their backward is softmax attention's with it (dS = P * (dP - D), D = rowsum(dO * O)), and
the sink's gradient is -sum over rows of exp(sink - L) * D, taken from the saved L (`sinks.sink_grad`). On
CUDA an unpadded half-precision chunk with sinks takes `BlockedFlashAttention` (torch's flash kernel, the
sink folded into its log-sum-exp: `sinks.fold_sinks`), any other (padded, packed rows, float32) these ops'
exact math, which holds the chunk's (B, H, c, e) scores as transformers' eager attention holds the whole
T x T; flash-attn's and SDPA's kernels take no sinks and are never used for them.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streambp_core.dtypes import at_least_float32
from streambp_core.engine.attention import blocked
from streambp_core.engine.attention.cuda import (
    cuda_attention,
    flash_attn_available,
    flash_caps,
    plan_kernel,
    sink_blocked_applies,
)
from streambp_core.engine.attention.sinks import sink_grad
from streambp_core.engine.attention.varlen import packed_cuda_attention
from streambp_core.engine.attention.workspace import backward_workspace_bytes
from streambp_core.engine.chunks import allowed_mask
from streambp_core.measure.tags import KERNEL_WORKSPACE, memory_category

__all__ = ["allowed_mask", "flash_attn_available", "prefix_attention"]


def prefix_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    key_valid: Tensor | None,
    scale: float,
    backend: str = "auto",
    window: int | None = None,
    blocking: bool = True,
    sinks: Tensor | None = None,
    softcap: float | None = None,
) -> Tensor:
    """Attention output (B, H, c, hd) of queries q (B, H, c, hd) against keys/values (B, Hkv, e, hd).

    `key_valid` (B, e) bool marks real (non-padding) keys, a (B, c, e) one the keys each query may see (its
    own document in a packed row, `engine.packing`); None means every key is real. A query row that
    sees no valid key outputs zeros, as torch SDPA does for a fully masked row. `window` (sliding-window
    attention): a query sees only itself and the `window - 1` keys before it; None: the whole prefix.
    `blocking` False: never the blocked backward (`cuda_attention.blocked_applies`), whatever the prefix.
    `sinks` (H,): each head's attention-sink logit in every row's denominator (module docstring), or None.
    `softcap`: the scaled scores become softcap * tanh(scores / softcap) (module docstring); None: none.
    """
    if window is not None and window >= k.shape[2]:
        window = None  # the band covers every key: plain causal attention
    if sinks is not None and q.device.type == "cuda":
        if blocking and softcap is None and sink_blocked_applies(q, key_valid):
            return blocked.BlockedFlashAttention.apply(q, k, v, scale, window, blocked.BLOCK_TOKENS, sinks)
        return math_attention(q, k, v, key_valid, scale, window, sinks, softcap)
    if q.device.type == "cuda" and softcap is not None and not flash_caps(backend, q, key_valid, window):
        return math_attention(q, k, v, key_valid, scale, window, sinks, softcap)
    if q.device.type == "cuda" and key_valid is not None and key_valid.dim() == 3:
        return packed_cuda_attention(q, k, v, key_valid, scale, backend, window, softcap)
    if q.device.type == "cuda":
        return cuda_attention(q, k, v, key_valid, scale, backend, window, blocking, softcap)
    if q.device.type == "meta":
        kernel = plan_kernel(backend, q, k, key_valid, window, simulated=True, blocking=blocking, sinks=sinks,
                             softcap=softcap)
        workspace = backward_workspace_bytes(kernel, q, k, window)
        return _SimulatedAttention.apply(q, k, v, key_valid, scale, window, workspace, sinks, softcap)
    return math_attention(q, k, v, key_valid, scale, window, sinks, softcap)


def math_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float,
                   window: int | None = None, sinks: Tensor | None = None,
                   softcap: float | None = None) -> Tensor:
    """The custom ops' exact attention on any device (CPU; on CUDA a chunk with sinks the blocked kernel
    does not take, or a soft-capped chunk flash-attn does not take): `prefix_attention`'s arguments, the
    output (B, H, c, hd)."""
    out, _ = torch.ops.streambp.prefix_attn_fwd(q, k, v, key_valid, scale, window, sinks, softcap)
    return out



class _SimulatedAttention(torch.autograd.Function):
    """The custom ops on meta tensors, whose backward holds `workspace_bytes` (a kernel's own buffers,
    filed under kernel_workspace) while the backward op allocates its gradients, as the kernel does."""

    @staticmethod
    def forward(ctx, q, k, v, key_valid, scale, window, workspace_bytes, sinks=None, softcap=None):
        out, lse = torch.ops.streambp.prefix_attn_fwd(q, k, v, key_valid, scale, window, sinks, softcap)
        ctx.save_for_backward(q, k, v, out, key_valid, None if sinks is None else lse, sinks)  # L: d sinks
        ctx.scale, ctx.window, ctx.workspace_bytes, ctx.softcap = scale, window, workspace_bytes, softcap
        return out

    @staticmethod
    def backward(ctx, grad_out):
        q, k, v, out, key_valid, lse, sinks = ctx.saved_tensors
        with memory_category(KERNEL_WORKSPACE):  # none for a path not modelled
            workspace = q.new_empty(ctx.workspace_bytes, dtype=torch.uint8) if ctx.workspace_bytes else None
        d_q, d_k, d_v = torch.ops.streambp.prefix_attn_bwd(
            grad_out, q, k, v, out, key_valid, ctx.scale, ctx.window, sinks, ctx.softcap)
        del workspace  # freed when the kernel returns
        d_sinks = None if sinks is None else sink_grad(grad_out, out, lse, sinks)
        return d_q, d_k, d_v, None, None, None, None, d_sinks, None


def _grouped(q: Tensor, num_kv_heads: int) -> Tensor:
    """(B, H, c, hd) -> (B, Hkv, g, c, hd): query head h uses KV head h // g, as `repeat_kv` does."""
    b, h, c, hd = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, c, hd)


def _probabilities(q, k, key_valid, scale, window, sinks=None, softcap=None):
    """Softmax probabilities (B, Hkv, g, c, e), log-sum-exp, and, under a soft-cap, the derivative of the
    capped scores by the scaled ones, 1 - tanh^2 (None without), in at least float32; with `sinks` (H,),
    each head's sink logit joins every row's denominator (the log-sum-exp includes it)."""
    work = at_least_float32(q.dtype)
    qg = _grouped(q, k.shape[1]).to(work)
    scores = qg @ k.to(work)[:, :, None].transpose(-1, -2) * scale
    cap_slope = None
    if softcap is not None:  # transformers' eager order: scale, / cap, tanh, * cap, then the mask
        capped = torch.tanh(scores / softcap)
        cap_slope = 1.0 - capped * capped
        scores = capped * softcap
    allowed = allowed_mask(q.shape[2], key_valid, k.shape[2], window)[:, None, None]  # (B|1, 1, 1, c, e)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    if sinks is not None:  # (H,) -> (1, Hkv, g, 1), as the query heads are grouped
        lse = torch.logaddexp(lse, sinks.to(work).reshape(1, k.shape[1], -1, 1))
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # fully masked rows: 0, as SDPA
    return probs, lse, cap_slope


@torch.library.custom_op("streambp::prefix_attn_fwd", mutates_args=())
def _prefix_attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float, window: int | None,
    sinks: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, Tensor]:
    probs, lse, _ = _probabilities(q, k, key_valid, scale, window, sinks, softcap)
    out = probs @ v.to(probs.dtype)[:, :, None]  # (B, Hkv, g, c, hd_v)
    laid_out_like_q = _output_like(q, v).copy_(out.reshape(*q.shape[:3], v.shape[-1]))  # the fake's layout
    return laid_out_like_q, lse.reshape(q.shape[:3]).to(_lse_dtype(q))


@_prefix_attn_fwd.register_fake
def _(q, k, v, key_valid, scale, window, sinks=None, softcap=None):
    return _output_like(q, v), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


def _output_like(q: Tensor, v: Tensor) -> Tensor:
    """An empty output (B, H, c, hd_v) in q's dtype: q's own layout when the value heads are as wide as the
    query heads, else laid out (B, c, H, hd_v) in memory, as the GPU kernels that take narrower values
    (latent attention: DeepSeek-V3's; torch SDPA's memory-efficient kernel) return it, so transformers'
    transpose back to (B, c, H * hd_v) is a view, not a copy of the output."""
    if v.shape[-1] == q.shape[-1]:
        return torch.empty_like(q)
    b, h, c, _ = q.shape
    return q.new_empty(b, c, h, v.shape[-1]).transpose(1, 2)


@torch.library.custom_op("streambp::prefix_attn_bwd", mutates_args=())
def _prefix_attn_bwd(
    grad_out: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    key_valid: Tensor | None,
    scale: float,
    window: int | None,
    sinks: Tensor | None = None, softcap: float | None = None,
) -> tuple[Tensor, Tensor, Tensor]:
    probs, _, cap_slope = _probabilities(q, k, key_valid, scale, window, sinks, softcap)
    work = probs.dtype
    hkv = k.shape[1]
    d_out = _grouped(grad_out, hkv).to(work)  # (B, Hkv, g, c, hd)
    d_v = (probs.transpose(-1, -2) @ d_out).sum(dim=2)
    d_probs = d_out @ v.to(work)[:, :, None].transpose(-1, -2)
    row_dot = (d_out * _grouped(out, hkv).to(work)).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - row_dot)
    d_scores = (d_scores if cap_slope is None else d_scores * cap_slope) * scale
    d_q = d_scores @ k.to(work)[:, :, None]
    d_k = (d_scores.transpose(-1, -2) @ _grouped(q, hkv).to(work)).sum(dim=2)
    # laid out as the fake kernel's (each input's own layout, as a GPU kernel returns its gradients)
    return (torch.empty_like(q).copy_(d_q.reshape(q.shape)), torch.empty_like(k).copy_(d_k),
            torch.empty_like(v).copy_(d_v))


@_prefix_attn_bwd.register_fake
def _(grad_out, q, k, v, out, key_valid, scale, window, sinks=None, softcap=None):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return at_least_float32(q.dtype)


def _setup_context(ctx, inputs, output):
    q, k, v, key_valid, scale, window, sinks, softcap = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, key_valid, None if sinks is None else lse, sinks)  # L: d sinks
    ctx.scale, ctx.window, ctx.softcap = scale, window, softcap


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, key_valid, lse, sinks = ctx.saved_tensors
    d_q, d_k, d_v = torch.ops.streambp.prefix_attn_bwd(
        grad_out, q, k, v, out, key_valid, ctx.scale, ctx.window, sinks, ctx.softcap
    )
    d_sinks = None if sinks is None else sink_grad(grad_out, out, lse, sinks)
    return d_q, d_k, d_v, None, None, None, d_sinks, None


_prefix_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
