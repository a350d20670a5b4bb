"""The CUDA paths of packed rows, run on CPU tensors: SDPA with the per-document mask, and flash-attn's
varlen kernel over (row, document) pieces against a stand-in `flash_attn` that computes attention by the
definition in float64 (window included); both equal the CPU kernel's result."""

from __future__ import annotations

import sys
import types

import pytest
import torch

from streambp_core.engine.attention import cuda as cuda_attention
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.attention.varlen import flash_packed_attention, packed_cuda_attention
from streambp_core.engine.packing import packed_rows


def banded(q, k, v, scale, window):
    """flash-attn's contract: (1, S, H, hd), GQA, causal (and window) aligned to the end of the keys."""
    sq, sk, groups = q.shape[1], k.shape[1], q.shape[2] // k.shape[2]
    k, v = k.repeat_interleave(groups, dim=2), v.repeat_interleave(groups, dim=2)
    scores = torch.einsum("bqhd,bkhd->bhqk", q, k) * scale
    distance = torch.arange(sq)[:, None] + (sk - sq) - torch.arange(sk)[None, :]
    seen = (distance >= 0) & (distance < (window[0] + 1 if window else sk))
    probs = scores.masked_fill(~seen, float("-inf")).softmax(dim=-1)
    return torch.einsum("bhqk,bkhd->bqhd", probs, v)


@pytest.fixture
def fake_flash(monkeypatch):
    calls: list = []

    def flash_attn_varlen_func(q, k, v, cu_q, cu_k, max_q, max_k, softmax_scale, causal, window_size=None):
        calls.append((cu_q.tolist(), cu_k.tolist(), max_q, max_k))
        assert causal and cu_q.dtype == cu_k.dtype == torch.int32
        pieces = [banded(q[None, cu_q[i]:cu_q[i + 1]], k[None, cu_k[i]:cu_k[i + 1]],
                         v[None, cu_k[i]:cu_k[i + 1]], softmax_scale, window_size)[0]
                  for i in range(len(cu_q) - 1)]
        return torch.cat(pieces)

    monkeypatch.setitem(sys.modules, "flash_attn",
                        types.SimpleNamespace(flash_attn_varlen_func=flash_attn_varlen_func))
    monkeypatch.setattr(cuda_attention, "flash_attn_available", lambda: True)
    monkeypatch.setattr(cuda_attention, "FLASH_DTYPES", (torch.float64,))
    return calls


def chunk(window):
    """Two packed rows of 12 tokens (row 0: documents 7, 5; row 1: 3, 5, 2 and 2 padding tokens) and the
    chunk 6..12 with its band."""
    positions = torch.tensor([[0, 1, 2, 3, 4, 5, 6, 0, 1, 2, 3, 4], [0, 1, 2, 0, 1, 2, 3, 4, 0, 1, 0, 0]])
    mask = torch.ones(2, 12, dtype=torch.long)
    mask[1, 10:] = 0
    packed = packed_rows(positions, mask, (2, 12))
    first, allowed = packed.chunk_keys(6, 12, 0)
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 12 - first, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    return q, k, v, allowed, window


@pytest.mark.parametrize("window", [None, 2])
def test_flash_varlen_pieces_match_the_cpu_kernel(fake_flash, window):
    q, k, v, allowed, window = chunk(window)
    expected = prefix_attention(q, k, v, allowed, 0.3, window=window)
    got = flash_packed_attention(q, k, v, allowed, 0.3, window)
    assert torch.allclose(got, expected, rtol=1e-12, atol=1e-12)
    assert torch.equal(got[1, :, 4:], torch.zeros_like(got[1, :, 4:])), "padding queries output zeros"
    # band 0..11 (row 0's token 6 is in its first document). Pieces: row 0 query 6 (keys 0..6), queries
    # 7..11 (keys 7..11); row 1 queries 6..7 (keys 3..7), 8..9 (keys 8..9); its padding in none
    assert fake_flash == [([0, 1, 6, 8, 10], [0, 7, 12, 17, 19], 5, 7)]


def test_sdpa_with_the_document_mask_matches_the_cpu_kernel():
    q, k, v, allowed, window = chunk(3)
    expected = prefix_attention(q, k, v, allowed, 0.3, window=window)
    got = packed_cuda_attention(q, k, v, allowed, 0.3, "sdpa", window)
    real = allowed.any(dim=-1)[:, None, :, None].expand_as(got)
    assert torch.allclose(got[real], expected[real], rtol=1e-12, atol=1e-12)
