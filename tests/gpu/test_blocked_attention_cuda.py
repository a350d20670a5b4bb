"""On a CUDA device: the blocked attention backward in bf16 against an fp32 reference (the flash-attention
rule: at most 2x plain bf16's error), and the memory it saves. Skipped without CUDA (`gpu` marker)."""

from __future__ import annotations

import pytest
import torch

from streambp_core.engine.attention import blocked as blocked_attention
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.attention.workspace import blocked_backward_bytes, flash_backward_bytes

pytestmark = pytest.mark.gpu


def _chunk(queries: int, keys: int, dtype: torch.dtype, heads: int = 16, kv_heads: int = 8, dim: int = 128):
    gen = torch.Generator(device="cuda").manual_seed(0)
    make = lambda *shape: torch.randn(*shape, generator=gen, device="cuda", dtype=dtype)  # noqa: E731
    q, k, v = make(1, heads, queries, dim), make(1, kv_heads, keys, dim), make(1, kv_heads, keys, dim)
    return q, k, v, make(1, heads, queries, dim)


def _grads(q, k, v, grad_out, blocking: bool, window: int | None = None):
    q, k, v = (x.detach().requires_grad_() for x in (q, k, v))
    out = prefix_attention(q, k, v, None, q.shape[-1] ** -0.5, "sdpa", window, blocking=blocking)
    return torch.autograd.grad(out, (q, k, v), grad_out)


@pytest.mark.parametrize("window", [None, 4096])
def test_blocked_bf16_gradients_follow_the_flash_attention_rule(monkeypatch, window):
    """500 queries against 40,000 keys (blocked from 32,768): each gradient's error against float32 is at
    most 2x the unblocked bf16 kernel's (tiles of 4,096 keys, so the prefix spans ten of them)."""
    monkeypatch.setattr(blocked_attention, "BLOCK_TOKENS", 4096)
    q, k, v, grad_out = _chunk(500, 40_000, torch.bfloat16)
    reference = _grads(*(x.float() for x in (q, k, v, grad_out)), blocking=False, window=window)
    plain = _grads(q, k, v, grad_out, blocking=False, window=window)
    blocked = _grads(q, k, v, grad_out, blocking=True, window=window)
    for ref, base, got in zip(reference, plain, blocked, strict=True):
        base_err = (base.float() - ref).abs().max()
        assert (got.float() - ref).abs().max() <= 2 * base_err


def test_blocked_backward_holds_what_the_simulator_says():
    """The allocator's peak over the backward, above what is live before it and the gradients returned, is
    near the blocked path's modelled buffers, and far below the unblocked kernel's at 200,000 keys."""
    queries, keys = 500, 200_000
    q, k, v, grad_out = _chunk(queries, keys, torch.bfloat16)
    q, k, v = (x.requires_grad_() for x in (q, k, v))
    out = prefix_attention(q, k, v, None, 128 ** -0.5, "sdpa")
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    grads = torch.autograd.grad(out, (q, k, v), grad_out)
    extra = torch.cuda.max_memory_allocated() - before - sum(g.numel() * g.element_size() for g in grads)
    modelled = blocked_backward_bytes(1, 16, 8, queries, keys, 128, 2, None, blocked_attention.BLOCK_TOKENS)
    assert abs(extra - modelled) <= 0.1 * modelled + 64 * 2**20  # slack: the allocator rounds blocks up
    assert extra < flash_backward_bytes(1, 16, 8, queries, keys, 128, 2) / 4
