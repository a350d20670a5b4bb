"""Packed rows' attention on CUDA: a chunk's queries against its key band under the per-document mask of
`packing.PackedRows.chunk_keys`, through flash-attn's varlen kernel or torch SDPA."""

from __future__ import annotations

import torch
from torch import Tensor

from streambp_core.engine.attention.cuda import choose_kernel, refuse_uncapped, sdpa_attention


def packed_cuda_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float, backend: str,
                          window: int | None, softcap: float | None = None) -> Tensor:
    """`prefix_attention` on CUDA with a per-document (B, c, e) mask (`PackedRows.chunk_keys`, no causality
    in it): flash-attn's varlen kernel when it is chosen (`flash_packed_attention`), else torch SDPA with a
    boolean mask (the lower-right causal band and the window folded in); soft-capped scores through
    flash-attn only (`prefix_attention` sends the others to the engine's exact custom ops)."""
    if choose_kernel(backend, q) == "flash":
        return flash_packed_attention(q, k, v, allowed, scale, window, softcap)
    refuse_uncapped(softcap)
    return sdpa_attention(q, k, v, allowed, scale, window)


def flash_packed_attention(q: Tensor, k: Tensor, v: Tensor, allowed: Tensor, scale: float,
                           window: int | None = None, softcap: float | None = None) -> Tensor:
    """flash-attn's varlen kernel, one sequence per (row, document) piece of the chunk.

    1. A real query's allowed keys are its document's keys in the band, contiguous, ending at the chunk's
       last query of that document; queries with the same first key form one piece.
    2. Pack the real queries (rows, then positions) and the keys any query sees, in the same order, so
       piece n's queries are the last of piece n's keys: causal varlen (and its window) aligns them.
    3. Scatter the outputs back; padding queries output zeros.
    """
    from flash_attn import flash_attn_varlen_func

    b, h, c, hd = q.shape
    real = allowed.any(dim=-1)  # (B, c)
    if not bool(real.any()):  # padding only
        return torch.zeros_like(q)
    first_key = allowed.int().argmax(dim=-1) + torch.arange(b, device=q.device)[:, None] * allowed.shape[-1]
    _, q_counts = torch.unique_consecutive(first_key[real], return_counts=True)
    key_counts = allowed.sum(dim=-1)[real]
    piece_starts = torch.nn.functional.pad(q_counts.cumsum(0)[:-1], (1, 0))
    k_counts = key_counts[piece_starts]
    cu_q = torch.nn.functional.pad(q_counts.cumsum(0, dtype=torch.int32), (1, 0))
    cu_k = torch.nn.functional.pad(k_counts.cumsum(0, dtype=torch.int32), (1, 0))
    seen = allowed.any(dim=1)  # (B, e): keys of the chunk's pieces
    packed_out = flash_attn_varlen_func(
        q.transpose(1, 2)[real], k.transpose(1, 2)[seen], v.transpose(1, 2)[seen], cu_q, cu_k,
        int(q_counts.max()), int(k_counts.max()), softmax_scale=scale, causal=True,
        **({} if window is None else {"window_size": (window - 1, 0)}),
        **({} if softcap is None else {"softcap": softcap}))
    return q.new_zeros(b, c, h, hd).index_put((real,), packed_out).transpose(1, 2)
