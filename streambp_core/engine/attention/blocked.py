"""Attention backward of one query chunk over tiles of keys, so that no buffer grows with the prefix.

Why: FlashAttention-2's backward (`mha_bwd` in flash-attn's `csrc/flash_attn/flash_api.cpp`, and in torch's
copy, `aten/src/ATen/native/transformers/cuda/flash_attn/flash_api.cpp`) allocates buffers of its own
that grow with the keys: with GQA, dK and dV expanded to every query head (`kernel_workspace.py` gives the
sizes). A StreamBP chunk attends to the whole prefix, so they grow with the sequence.

The decomposition is exact. With the forward's output O and row log-sum-exp L known, the backward of
softmax attention splits over tiles (query rows x key columns); for one tile:
1. P = exp(scale * Q K^T - L), masked entries 0: the tile's probabilities, exact because L is global;
2. D = rowsum(dO * O): the rows' value, the same for every tile;
3. dV_tile = P^T dO, dP = dO V^T, dS = P * (dP - D) * scale;
4. dQ_share = dS K (a row sums its tiles' shares), dK_tile = dS^T Q (a key sums its tiles').
No tile needs another's values, so dQ, dK and dV are sums of tile shares, in any order.

Tiles (`attention_tiles`), for queries that are the last c of e positions (lower-right aligned):
1. query blocks of at most `block_tokens` rows;
2. without a window, the keys a block's rows see (0 up to the last row's own position) cut into blocks of
   at most `block_tokens` keys, from that last key backwards: the last tile is causal (flash's lower-right
   causal mask is exactly the chunk's there), every earlier one is seen whole by every row (no mask),
   because it ends at least one block before the last row's position;
3. with a sliding window, one tile per query block: the band its rows see, at most block + window - 1
   keys, with flash's window (window - 1 keys left of the diagonal, causal on the right).

Kernels:
- CUDA (`BlockedFlashAttention`): torch's FlashAttention-2 (`aten._flash_attention_forward/_backward`):
  one forward over the chunk, keeping its log-sum-exp; in backward one flash backward per tile with that
  log-sum-exp, dQ summed in (at least) float32. `cuda_attention.blocked_applies` says when it runs (unpadded
  half-precision chunks with a long prefix); shorter prefixes keep the faster unblocked kernels.
- Attention sinks (gpt-oss): the forward's output and log-sum-exp are rescaled by the sinks
  (`sinks.fold_sinks`); every tile's backward then takes that log-sum-exp and output (`sinks`' step 2), and
  the sinks' gradient comes from the rows' D once per chunk (`sinks.sink_grad`).
- CPU reference (`reference_blocked_backward`): the same tiles, exact math in at least float32 (float64
  stays float64), with the full mask (padding too); the tests hold it to the unblocked backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from streambp_core.dtypes import at_least_float32
from streambp_core.engine.attention.sinks import fold_sinks, sink_grad
from streambp_core.engine.chunks import allowed_mask, chunk_bounds, window_start

BLOCK_TOKENS = 16384
"""Most query rows and keys of one tile."""
BLOCKED_MIN_KEYS = 32768
"""Prefixes of at most this many keys keep the unblocked kernels (`cuda_attention.blocked_applies`)."""


@dataclass(frozen=True)
class Tile:
    """Query rows [q_start, q_stop) against keys [k_start, k_stop) of one chunk (module docstring)."""

    q_start: int
    q_stop: int
    k_start: int
    k_stop: int
    causal: bool
    """Flash's lower-right causal mask inside the tile; False: every row sees every key of the tile."""
    window_left: int | None
    """Flash's `window_size_left` (keys a row sees left of its diagonal); None: unbounded."""


def attention_tiles(num_queries: int, num_keys: int, window: int | None, block_tokens: int) -> list[Tile]:
    """The tiles of a chunk of `num_queries` queries, the last of `num_keys` positions (module docstring)."""
    offset = num_keys - num_queries
    tiles = []
    for q_start, q_stop in chunk_bounds(num_queries, block_tokens):
        end = offset + q_stop  # the block's last row sees keys up to end - 1
        if window is not None:
            start = window_start(end, q_stop - q_start, window)
            tiles.append(Tile(q_start, q_stop, start, end, causal=True, window_left=window - 1))
            continue
        stop, causal = end, True
        while stop > 0:
            start = max(0, stop - block_tokens)
            tiles.append(Tile(q_start, q_stop, start, stop, causal=causal, window_left=None))
            stop, causal = start, False
    return tiles


def _grouped(x: Tensor, num_kv_heads: int) -> Tensor:
    """(B, H, n, hd) -> (B, Hkv, g, n, hd): query head h uses KV head h // g."""
    b, h, n, hd = x.shape
    return x.reshape(b, num_kv_heads, h // num_kv_heads, n, hd)


def reference_blocked_backward(
    grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor, key_valid: Tensor | None,
    scale: float, window: int | None, block_tokens: int,
) -> tuple[Tensor, Tensor, Tensor]:
    """(dq, dk, dv) laid out as q, k, v: the chunk's attention backward tile by tile (module docstring,
    steps 1-4), from its output `out` (B, H, c, hd) and log-sum-exp `lse` (B, H, c)."""
    work = at_least_float32(q.dtype)
    hkv, c, e = k.shape[1], q.shape[2], k.shape[2]
    allowed = allowed_mask(c, key_valid, e, window)[:, None, None]  # (B|1, 1, 1, c, e)
    qg, dog = _grouped(q, hkv).to(work), _grouped(grad_out, hkv).to(work)  # (B, Hkv, g, c, hd)
    row_dot = (dog * _grouped(out, hkv).to(work)).sum(dim=-1, keepdim=True)  # D, step 2
    row_lse = lse.to(work).reshape(qg.shape[:-1])[..., None]
    kg, vg = k.to(work)[:, :, None], v.to(work)[:, :, None]  # (B, Hkv, 1, e, hd)
    d_q = torch.zeros_like(qg)
    d_k, d_v = k.new_zeros(k.shape, dtype=work), v.new_zeros(v.shape, dtype=work)
    for tile in attention_tiles(c, e, window, block_tokens):
        rows, keys = slice(tile.q_start, tile.q_stop), slice(tile.k_start, tile.k_stop)
        scores = qg[..., rows, :] @ kg[..., keys, :].transpose(-1, -2) * scale
        probs = torch.exp(scores - row_lse[..., rows, :]).masked_fill(~allowed[..., rows, keys], 0.0)
        d_v[:, :, keys] += (probs.transpose(-1, -2) @ dog[..., rows, :]).sum(dim=2)
        d_probs = dog[..., rows, :] @ vg[..., keys, :].transpose(-1, -2)
        d_scores = probs * (d_probs - row_dot[..., rows, :]) * scale
        d_q[..., rows, :] += d_scores @ kg[..., keys, :]
        d_k[:, :, keys] += (d_scores.transpose(-1, -2) @ qg[..., rows, :]).sum(dim=2)
    return (torch.empty_like(q).copy_(d_q.reshape(q.shape)), torch.empty_like(k).copy_(d_k),
            torch.empty_like(v).copy_(d_v))


def _flash_window(window_left: int | None) -> dict:
    """Flash's band arguments: `window_left` keys left of the diagonal, none right of it; {} unbanded."""
    return {} if window_left is None else {"window_size_left": window_left, "window_size_right": 0}


def flash_forward(q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None):
    """torch's FlashAttention-2 forward, lower-right causal, on (B, T, heads, hd) tensors:
    (out (B, c, H, hd), lse (B, H, c) float32, rng_state, unused) as its backward takes them."""
    left = None if window is None else window - 1
    out, lse, rng_state, unused, _ = torch.ops.aten._flash_attention_forward(
        q, k, v, None, None, q.shape[1], k.shape[1], 0.0, True, False, scale=scale, **_flash_window(left))
    return out, lse, rng_state, unused


def flash_tile_backward(grad_out: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
                        rng_state: Tensor, unused: Tensor, scale: float, tile: Tile):
    """torch's FlashAttention-2 backward of one tile, (B, T, heads, hd) tensors, the chunk's `lse` rows:
    (dq share (B, m, H, hd), dk (B, n, Hkv, hd), dv)."""
    return torch.ops.aten._flash_attention_backward(
        grad_out, q, k, v, out, lse, None, None, q.shape[1], k.shape[1], 0.0, tile.causal, rng_state, unused,
        scale=scale, **_flash_window(tile.window_left))


def blocked_flash_backward(grad_out, q, k, v, out, lse, rng_state, unused, scale, window, block_tokens):
    """(dq, dk, dv) shaped (B, heads, T, hd) like q, k, v: one `flash_tile_backward` per tile; `out` is the
    forward's (B, c, H, hd) output and `lse` its (B, H, c) log-sum-exp."""
    qt, kt, vt = (x.transpose(1, 2) for x in (q, k, v))  # (B, T, heads, hd) views
    grad_t = grad_out.transpose(1, 2).contiguous()  # a view of the o_proj input's gradient: no copy
    d_q = torch.zeros(qt.shape, dtype=at_least_float32(q.dtype), device=q.device)
    d_k, d_v = torch.zeros_like(kt), torch.zeros_like(vt)
    for tile in attention_tiles(q.shape[2], k.shape[2], window, block_tokens):
        rows, keys = slice(tile.q_start, tile.q_stop), slice(tile.k_start, tile.k_stop)
        dq_share, dk_tile, dv_tile = flash_tile_backward(
            grad_t[:, rows], qt[:, rows], kt[:, keys], vt[:, keys], out[:, rows],
            lse[:, :, rows].contiguous(), rng_state, unused, scale, tile)
        d_q[:, rows] += dq_share
        d_k[:, keys] += dk_tile
        d_v[:, keys] += dv_tile
    return d_q.to(q.dtype).transpose(1, 2), d_k.transpose(1, 2), d_v.transpose(1, 2)


class BlockedFlashAttention(torch.autograd.Function):
    """Lower-right causal attention of (B, H, c, hd) queries against (B, Hkv, e, hd) keys/values whose
    backward runs tile by tile (module docstring). `apply(q, k, v, scale, window, block_tokens, sinks)`,
    `sinks` (H,) each head's attention-sink logit, or None."""

    @staticmethod
    def forward(ctx, q: Tensor, k: Tensor, v: Tensor, scale: float, window: int | None,
                block_tokens: int, sinks: Tensor | None = None) -> Tensor:
        out, lse, rng_state, unused = flash_forward(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                                    scale, window)
        if sinks is not None:
            out, lse = fold_sinks(out, lse, sinks)
        ctx.save_for_backward(q, k, v, out, lse, rng_state, unused, sinks)
        ctx.scale, ctx.window, ctx.block_tokens = scale, window, block_tokens
        return out.transpose(1, 2)

    @staticmethod
    def backward(ctx, grad_out: Tensor):
        q, k, v, out, lse, rng_state, unused, sinks = ctx.saved_tensors
        grads = blocked_flash_backward(grad_out, q, k, v, out, lse, rng_state, unused, ctx.scale, ctx.window,
                                       ctx.block_tokens)
        d_sinks = None if sinks is None else sink_grad(grad_out, out.transpose(1, 2), lse, sinks)
        return (*grads, None, None, None, d_sinks)
