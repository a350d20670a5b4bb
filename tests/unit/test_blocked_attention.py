"""The attention backward over tiles of keys: the CPU reference against the unblocked backward in float64,
the tiles against flash's mask rules, and the CUDA path's tile loop run on CPU tensors through stand-ins
for torch's flash kernels that compute FlashAttention-2's contract by the definition, in float64."""

from __future__ import annotations

import pytest
import torch

from streambp_core.engine.attention import blocked as blocked_attention
from streambp_core.engine.attention import cuda as cuda_attention
from streambp_core.engine.attention.blocked import attention_tiles, reference_blocked_backward
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import allowed_mask
from tests.unit.test_cuda_attention import padding


def _inputs(batch, heads, kv_heads, queries, keys, dim=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    make = lambda *shape: torch.randn(*shape, generator=gen, dtype=torch.float64)  # noqa: E731
    kv_shape = (batch, kv_heads, keys, dim)
    return make(batch, heads, queries, dim), make(*kv_shape), make(*kv_shape)


def _rel_err(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).detach().abs().max() / want.detach().abs().max())


@pytest.mark.parametrize("kv_heads", [1, 2, 4])
@pytest.mark.parametrize("pad", [None, "right", "left", "holes"])
@pytest.mark.parametrize("window", [None, 3, 6])
@pytest.mark.parametrize("block_tokens", [1, 2, 4, 64])
def test_reference_blocked_backward_equals_the_unblocked_one(kv_heads, pad, window, block_tokens):
    """float64: the tile-by-tile backward (5 queries, 9 keys: neither divisible by the blocks) gives the
    unblocked op's dq, dk, dv to 1e-12, with GQA, padding (rows of only padding included) and windows."""
    q, k, v = _inputs(3, 4, kv_heads, 5, 9)
    key_valid = None if pad is None else padding(pad)
    out, lse = torch.ops.streambp.prefix_attn_fwd(q, k, v, key_valid, 0.3, window)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(1), dtype=torch.float64)
    want = torch.ops.streambp.prefix_attn_bwd(grad_out, q, k, v, out, key_valid, 0.3, window)
    got = reference_blocked_backward(grad_out, q, k, v, out, lse, key_valid, 0.3, window, block_tokens)
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and g.stride() == w.stride()
        assert _rel_err(g, w) < 1e-12


def flash_mask(rows: int, keys: int, causal: bool, left: int | None, right: int | None) -> torch.Tensor:
    """(rows, keys) mask of FlashAttention-2 (`flash_api.cpp`, `mask.h`): key j is seen by row i when
    i + keys - rows - left <= j <= i + keys - rows + right; causal sets right to 0; a window of at
    least `keys` is unbounded (None)."""
    assert left is None or left >= 0, "flash reads a negative window as unbounded"
    assert right is None or right >= 0, "flash reads a negative window as unbounded"
    right = 0 if causal else right
    left = None if left is not None and left >= keys else left
    right = None if right is not None and right >= keys else right
    distance = torch.arange(keys)[None, :] - torch.arange(rows)[:, None] - (keys - rows)
    seen = torch.ones(rows, keys, dtype=torch.bool)
    if right is not None:
        seen &= distance <= right
    if left is not None:
        seen &= distance >= -left
    return seen


@pytest.mark.parametrize("queries,keys", [(1, 1), (3, 3), (5, 9), (7, 40), (16, 16), (13, 100)])
@pytest.mark.parametrize("window", [None, 1, 4, 11, 200])
@pytest.mark.parametrize("block_tokens", [1, 3, 8, 500])
def test_tiles_cover_the_chunk_mask_once_under_flash_rules(queries, keys, window, block_tokens):
    """Every (query, key) pair the chunk allows is in exactly one tile, where flash's own mask allows it,
    and no other pair is; no tile is larger than block_tokens rows by block_tokens (+ window) keys."""
    window = None if window is not None and window >= keys else window
    covered = torch.zeros(queries, keys, dtype=torch.int64)
    for tile in attention_tiles(queries, keys, window, block_tokens):
        rows, cols = tile.q_stop - tile.q_start, tile.k_stop - tile.k_start
        assert rows <= block_tokens
        assert cols <= (block_tokens if window is None else block_tokens + window - 1)
        seen = flash_mask(rows, cols, tile.causal, tile.window_left, None)
        covered[tile.q_start:tile.q_stop, tile.k_start:tile.k_stop] += seen
    assert torch.equal(covered, allowed_mask(queries, None, keys, window)[0].long())


def _definition(q, k, v, scale, seen):
    """(probabilities, log-sum-exp) of (B, m, H, hd) queries against (B, n, Hkv, hd) keys under `seen`."""
    groups = q.shape[2] // k.shape[2]
    k = k.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    scores = scores.masked_fill(~seen, float("-inf"))
    lse = torch.logsumexp(scores, dim=-1)
    return torch.exp(scores - lse[..., None]), lse


def fake_flash_forward(q, k, v, scale, window):
    """torch's `_flash_attention_forward` by the definition (lower-right causal, optional band)."""
    seen = flash_mask(q.shape[1], k.shape[1], True, None if window is None else window - 1, None)
    probs, lse = _definition(q, k, v, scale, seen)
    out = torch.einsum("bhqk,bkhd->bqhd", probs, v.repeat_interleave(q.shape[2] // k.shape[2], dim=2))
    return out, lse, torch.zeros(2), torch.zeros(())


def fake_flash_backward(calls):
    """torch's `_flash_attention_backward` by the definition, from the given log-sum-exp rows."""

    def backward(grad_out, q, k, v, out, lse, rng_state, unused, scale, tile):
        assert lse.is_contiguous() and q.stride(-1) == k.stride(-1) == grad_out.stride(-1) == 1
        calls.append(tile)
        groups = q.shape[2] // k.shape[2]
        k_x, v_x = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
        seen = flash_mask(q.shape[1], k.shape[1], tile.causal, tile.window_left, None)
        scores = torch.einsum("bqhd,bkhd->bhqk", q, k_x) * scale
        probs = torch.exp(scores - lse[..., None]).masked_fill(~seen, 0.0)
        row_dot = (grad_out * out).sum(-1).transpose(1, 2)[..., None]  # D: (B, H, m, 1)
        d_v = torch.einsum("bhqk,bqhd->bkhd", probs, grad_out)
        d_scores = probs * (torch.einsum("bqhd,bkhd->bhqk", grad_out, v_x) - row_dot) * scale
        d_q = torch.einsum("bhqk,bkhd->bqhd", d_scores, k_x)
        d_k = torch.einsum("bhqk,bqhd->bkhd", d_scores, q)
        fold = lambda x: x.unflatten(2, (k.shape[2], groups)).sum(3)  # noqa: E731  (the GQA sum)
        return d_q, fold(d_k), fold(d_v)

    return backward


@pytest.fixture
def fake_torch_flash(monkeypatch):
    """torch's flash kernels replaced by the stand-ins, taking float64; tiles of 3, blocking from 4 keys."""
    calls: list = []
    monkeypatch.setattr(blocked_attention, "flash_forward", fake_flash_forward)
    monkeypatch.setattr(blocked_attention, "flash_tile_backward", fake_flash_backward(calls))
    monkeypatch.setattr(cuda_attention, "FLASH_DTYPES", (torch.float64,))
    monkeypatch.setattr(blocked_attention, "BLOCK_TOKENS", 3)
    monkeypatch.setattr(blocked_attention, "BLOCKED_MIN_KEYS", 4)
    return calls


@pytest.mark.parametrize("kv_heads", [1, 2])
@pytest.mark.parametrize("queries,keys", [(1, 11), (5, 11), (7, 8)])
@pytest.mark.parametrize("window", [None, 2, 5])
def test_the_cuda_blocked_path_is_exact(fake_torch_flash, kv_heads, queries, keys, window):
    """`cuda_attention` on a long unpadded prefix runs the tile loop; output and gradients equal the
    unblocked custom op's to 1e-12, and no backward call sees more than a tile (3, + window) of keys."""
    q, k, v = (x.requires_grad_() for x in _inputs(2, 4, kv_heads, queries, keys))
    window = None if window is not None and window >= keys else window
    assert cuda_attention.plan_kernel("sdpa", q, k, None, window) == "blocked"
    out = cuda_attention.cuda_attention(q, k, v, None, 0.3, "sdpa", window)
    grad_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(2), dtype=torch.float64)
    got = torch.autograd.grad(out, (q, k, v), grad_out)
    want_out = prefix_attention(q, k, v, None, 0.3, "sdpa", window)
    want = torch.autograd.grad(want_out, (q, k, v), grad_out)
    assert _rel_err(out, want_out) < 1e-12
    for g, w in zip(got, want, strict=True):
        assert g.shape == w.shape and _rel_err(g, w) < 1e-12
    bound = 3 if window is None else 3 + window - 1
    assert fake_torch_flash and all(t.k_stop - t.k_start <= bound for t in fake_torch_flash)


def test_short_padded_or_square_chunks_keep_the_unblocked_kernels(fake_torch_flash):
    """Blocking starts above BLOCKED_MIN_KEYS keys, and never takes a padded or a square chunk."""
    q, k, _ = _inputs(3, 4, 2, 2, 9)
    assert cuda_attention.blocked_applies(q, k, None)
    assert not cuda_attention.blocked_applies(q, k[:, :, :4], None)  # 4 keys: not above the threshold
    assert not cuda_attention.blocked_applies(q, k, padding("right"))
    square, keys, _ = _inputs(3, 4, 2, 9, 9)
    assert not cuda_attention.blocked_applies(square, keys, None)
    assert not cuda_attention.blocked_applies(q.float(), k.float(), None)  # not a flash precision
