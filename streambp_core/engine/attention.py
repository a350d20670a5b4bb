"""Causal attention of a query chunk against its key/value prefix, aligned lower-right.

The queries of a chunk are the last `c` positions of the `e` keys they see, so query row i may attend to
keys 0 .. e - c + i (flash-attn's `causal=True`; SDPA's `causal_lower_right`, never `is_causal`, which aligns
top-left). Keys and values stay at the KV-head count (GQA/MQA) throughout.

Kernels:
- CUDA: flash-attn when importable and chosen, otherwise SDPA (lower-right bias keeps its flash kernel; a
  padded batch needs a boolean mask).
- CPU and meta: the `streambp::prefix_attn_fwd/_bwd` custom ops. Their CPU kernels are exact math in the
  input precision (float64 stays float64); their fake kernels allocate what a flash kernel allocates (the
  output and a float32 log-sum-exp, never a score matrix), so a simulated step on the meta device sees the
  memory a GPU step would.
"""

from __future__ import annotations

import importlib.util
import warnings

import torch
import torch.nn.functional as F
from torch import Tensor
from torch.nn.attention.bias import causal_lower_right
from torch.utils._python_dispatch import _disable_current_modes


def prefix_attention(
    q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float, backend: str = "auto"
) -> Tensor:
    """Attention output (B, H, c, hd) of queries q (B, H, c, hd) against keys/values (B, Hkv, e, hd).

    `key_valid` (B, e) bool marks real (non-padding) keys; None means every key is real. A query row that
    sees no valid key outputs zeros, as torch SDPA does for a fully masked row.
    """
    if q.device.type == "cuda":
        return _cuda_attention(q, k, v, key_valid, scale, backend)
    out, _ = torch.ops.streambp.prefix_attn_fwd(q, k, v, key_valid, scale)
    return out


def flash_attn_available() -> bool:
    """True when the optional flash-attn package is importable."""
    return importlib.util.find_spec("flash_attn") is not None


def _cuda_attention(q, k, v, key_valid, scale, backend):
    if backend == "flash" and not flash_attn_available():
        warnings.warn("flash-attn is not importable; attention falls back to torch SDPA", stacklevel=3)
    if key_valid is None and backend != "sdpa" and flash_attn_available():
        from flash_attn import flash_attn_func

        out = flash_attn_func(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                              softmax_scale=scale, causal=True)
        return out.transpose(1, 2)
    gqa = q.shape[1] != k.shape[1]
    if key_valid is None:
        bias = lower_right_bias(q.shape[2], k.shape[2])
        return F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=gqa)
    mask = allowed_mask(q.shape[2], key_valid)[:, None]
    if gqa:  # SDPA's masked CUDA kernels do not take GQA: expand K/V to the query heads.
        groups = q.shape[1] // k.shape[1]
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)


def lower_right_bias(num_queries: int, num_keys: int):
    """torch's lower-right causal bias. It is a tensor subclass, built with dispatch modes (a memory
    tracker) suspended: a mode that has already wrapped the raw tensor would make its construction fail."""
    with _disable_current_modes():
        return causal_lower_right(num_queries, num_keys)


def allowed_mask(num_queries: int, key_valid: Tensor | None, num_keys: int | None = None) -> Tensor:
    """Boolean (B or 1, c, e) mask: lower-right causal and, when given, the key padding."""
    e = key_valid.shape[1] if key_valid is not None else num_keys
    device = key_valid.device if key_valid is not None else None
    q_pos = torch.arange(e - num_queries, e, device=device)
    causal = q_pos[:, None] >= torch.arange(e, device=device)[None, :]  # (c, e)
    if key_valid is None:
        return causal[None]
    return causal[None] & key_valid[:, None, :]


def _grouped(q: Tensor, num_kv_heads: int) -> Tensor:
    """(B, H, c, hd) -> (B, Hkv, g, c, hd): query head h uses KV head h // g, as `repeat_kv` does."""
    b, h, c, hd = q.shape
    return q.reshape(b, num_kv_heads, h // num_kv_heads, c, hd)


def _probabilities(q, k, key_valid, scale):
    """Softmax probabilities (B, Hkv, g, c, e) and log-sum-exp, in at least float32."""
    work = torch.promote_types(q.dtype, torch.float32)
    qg = _grouped(q, k.shape[1]).to(work)
    scores = qg @ k.to(work)[:, :, None].transpose(-1, -2) * scale
    allowed = allowed_mask(q.shape[2], key_valid, k.shape[2])[:, None, None]  # (B|1, 1, 1, c, e)
    scores = scores.masked_fill(~allowed, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    probs = torch.exp(scores - lse[..., None]).nan_to_num(0.0)  # fully masked rows: 0, as SDPA
    return probs, lse


@torch.library.custom_op("streambp::prefix_attn_fwd", mutates_args=())
def _prefix_attn_fwd(
    q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float
) -> tuple[Tensor, Tensor]:
    probs, lse = _probabilities(q, k, key_valid, scale)
    out = probs @ v.to(probs.dtype)[:, :, None]  # (B, Hkv, g, c, hd)
    laid_out_like_q = torch.empty_like(q).copy_(out.reshape(q.shape))  # the fake kernel's layout
    return laid_out_like_q, lse.reshape(q.shape[:3]).to(_lse_dtype(q))


@_prefix_attn_fwd.register_fake
def _(q, k, v, key_valid, scale):
    return torch.empty_like(q), q.new_empty(q.shape[:3], dtype=_lse_dtype(q))


@torch.library.custom_op("streambp::prefix_attn_bwd", mutates_args=())
def _prefix_attn_bwd(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, key_valid: Tensor | None, scale: float
) -> tuple[Tensor, Tensor, Tensor]:
    probs, _ = _probabilities(q, k, key_valid, scale)
    work = probs.dtype
    hkv = k.shape[1]
    d_out = _grouped(grad_out, hkv).to(work)  # (B, Hkv, g, c, hd)
    d_v = (probs.transpose(-1, -2) @ d_out).sum(dim=2)
    d_probs = d_out @ v.to(work)[:, :, None].transpose(-1, -2)
    row_dot = (d_out * _grouped(out, hkv).to(work)).sum(dim=-1, keepdim=True)
    d_scores = probs * (d_probs - row_dot) * scale
    d_q = d_scores @ k.to(work)[:, :, None]
    d_k = (d_scores.transpose(-1, -2) @ _grouped(q, hkv).to(work)).sum(dim=2)
    return d_q.reshape(q.shape).to(q.dtype), d_k.to(k.dtype), d_v.to(v.dtype)


@_prefix_attn_bwd.register_fake
def _(grad_out, q, k, v, out, key_valid, scale):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _lse_dtype(q: Tensor) -> torch.dtype:
    return torch.promote_types(q.dtype, torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, key_valid, scale = inputs
    out, _ = output
    ctx.save_for_backward(q, k, v, out, key_valid)
    ctx.scale = scale


def _backward(ctx, grad_out, grad_lse):
    q, k, v, out, key_valid = ctx.saved_tensors
    d_q, d_k, d_v = torch.ops.streambp.prefix_attn_bwd(grad_out, q, k, v, out, key_valid, ctx.scale)
    return d_q, d_k, d_v, None, None


_prefix_attn_fwd.register_autograd(_backward, setup_context=_setup_context)
