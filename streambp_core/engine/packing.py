"""Packed rows: several documents in one row, told apart by `position_ids` that restart at 0.

TRL's `SFTConfig(packing=True)` / `padding_free=True` and transformers' `DataCollatorWithFlattening` give
each document positions 0, 1, ... so that RoPE sees each document from its start, and attention must
stay causal within each document (block-diagonal causal, with a layer's sliding window inside it).

Rules (checked by `packed_rows`, each violation one ConfigError naming row and token):
1. A document starts at the row's first real token, at a real token after padding, or where the position
   is 0; a real token after padding must have position 0.
2. Inside a document positions increase by exactly 1 (transformers' own rule for a new document, a step
   other than +1, agrees with this on every input that passes these checks).
3. Padding (attention_mask 0) belongs to no document: no query sees it.

What the engine does with them: RoPE from the given positions; each chunk's queries see only keys of
their own document (a (B, c, e) boolean mask, `chunk_keys`), and a chunk's key band starts no earlier than
the earliest document any row's chunk begins in, so a chunk that starts new documents in every row needs
no prefix at all (kernels: the CPU op with that mask; on CUDA flash-attn's varlen kernel over the chunk's
(row, document) pieces, or SDPA with the mask: `attention.varlen`). The transformers baselines get the
same through transformers' own packed path (`hf_position_ids` with no attention mask: it masks per
document from the position restarts) or, under the engine attention, a (B, 1, T, T) per-document mask.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from streambp_core.config import ConfigError

IGNORE_INDEX = -100
PACKING_ARGUMENTS = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "seq_idx")
"""Forward arguments a padding-free collator adds for flash-attn's varlen kernel (TRL's); they describe the
documents that `position_ids` describe, and give them when `position_ids` are absent (`call_position_ids`)."""


@dataclass(frozen=True)
class PackedRows:
    """The documents of a batch of packed rows (B, T)."""

    positions: Tensor
    """(B, T) int64 RoPE positions, as given (padding keeps what the caller gave)."""
    doc_ids: Tensor
    """(B, T) int64: 1, 2, ... the document of each real token in its row; 0 for padding."""
    first_keys: tuple[int, ...]
    """Per position t: the earliest start, over the rows, of the document that holds t (host ints)."""
    lengths: tuple[tuple[int, ...], ...]
    """Per row, its documents' lengths in tokens, in order (padding not counted)."""

    def chunk_keys(self, start: int, end: int, first: int) -> tuple[int, Tensor]:
        """Key band and mask of the query chunk start..end whose band (causal, window) begins at `first`.

        Returns (first key, allowed (B, c, e) bool): the band narrowed to the chunk's documents, and which
        of its keys each query may see besides causality and the window (its own document's real tokens).
        """
        first = max(first, self.first_keys[start])
        queries, keys = self.doc_ids[:, start:end], self.doc_ids[:, first:end]
        allowed = (queries[:, :, None] == keys[:, None, :]) & (keys > 0)[:, None, :]
        return first, allowed

    def attention_mask(self) -> Tensor:
        """(B, 1, T, T) bool: key j is in query i's document (causality and windows come from the kernel)."""
        return self.chunk_keys(0, self.doc_ids.shape[1], 0)[1][:, None]

    def hf_position_ids(self) -> Tensor:
        """Positions for transformers' own packed path (no attention mask): padding at 0, so each padding
        token is a document of its own that no real token sees."""
        return self.positions.masked_fill(self.doc_ids == 0, 0)

    @property
    def padded(self) -> bool:
        """Whether any row holds padding."""
        return sum(map(sum, self.lengths)) < self.doc_ids.numel()


def query_rows(allowed: Tensor | None, num_queries: int) -> Tensor | None:
    """(B, c) real queries of a chunk from its key mask: (B, e) key validity, or a (B, c, e) per-document
    mask (a real query sees its own key)."""
    if allowed is None or allowed.dim() == 2:
        return None if allowed is None else allowed[:, -num_queries:]
    return allowed[:, :, -num_queries:].diagonal(dim1=1, dim2=2)


def packed_rows(position_ids: Tensor | None, attention_mask: Tensor | None, shape: tuple[int, int]
                ) -> PackedRows | None:
    """The documents of rows of `shape` (B, T) from their `position_ids` ((B, T) or (1, T)), or None when
    there are none to tell apart (no position_ids, or 0..T-1 in every row). ConfigError on bad input."""
    if position_ids is None:
        return None
    rows_ok = position_ids.dim() == 2 and position_ids.shape[0] in (1, shape[0])
    if not rows_ok or position_ids.shape[-1] != shape[1]:
        raise ConfigError(f"position_ids shape {tuple(position_ids.shape)} does not match input_ids "
                          f"{tuple(shape)}: give one position per token (batch x seq_len, or 1 x seq_len)")
    if position_ids.device.type == "meta":
        raise ConfigError("packed rows need real position_ids, not meta tensors: a simulated step of an "
                          "unpacked row of the same length has the same peak memory (`step.estimate.packed`)")
    positions = position_ids.long().expand(shape[0], -1)
    if bool((positions == torch.arange(shape[1], device=positions.device)).all()):
        return None
    valid = torch.ones(shape, dtype=torch.bool, device=positions.device)
    if attention_mask is not None:
        valid = attention_mask.bool()
    starts = _document_starts(positions, valid)
    doc_ids = torch.cumsum(starts, dim=1) * valid
    index = torch.arange(shape[1], device=positions.device).expand(shape[0], -1)
    start_of = torch.cummax(torch.where(starts | ~valid, index, 0), dim=1).values
    return PackedRows(positions=positions, doc_ids=doc_ids,
                      first_keys=tuple(start_of.amin(dim=0).tolist()), lengths=_lengths(doc_ids))


def _document_starts(positions: Tensor, valid: Tensor) -> Tensor:
    """(B, T) bool: real tokens that start a document (module docstring, rules 1-2)."""
    before_valid = torch.nn.functional.pad(valid[:, :-1], (1, 0), value=False)
    follows_pad = valid & ~before_valid
    follows_pad[:, 0] = False  # a row's first token may start anywhere
    step = positions - torch.nn.functional.pad(positions[:, :-1], (1, 0), value=-1)
    restart = valid & (positions == 0)
    bad_after_pad = follows_pad & ~restart
    bad_step = valid & before_valid & ~restart & (step != 1)
    for bad, rule in ((bad_after_pad, "a document after padding must start at position 0"),
                      (bad_step, "position_ids must increase by 1 within a document and restart at 0 "
                                 "for the next (packed rows)")):
        if bool(bad.any()):
            row, token = (int(i) for i in bad.nonzero()[0])
            got = positions[row, max(token - 1, 0):token + 1].tolist()
            raise ConfigError(f"{rule}; row {row}, token {token}: positions {got}")
    first_real = valid & ~before_valid
    return valid & (restart | first_real)


def _lengths(doc_ids: Tensor) -> tuple[tuple[int, ...], ...]:
    rows = []
    for row in doc_ids.cpu():
        counts = torch.bincount(row, minlength=int(row.max()) + 1)[1:]
        rows.append(tuple(int(n) for n in counts))
    return tuple(rows)


def document_labels(input_ids: Tensor, packed: PackedRows) -> Tensor:
    """Labels for packed rows when none are given: the inputs, padding and each document's first token
    ignored (as TRL's and transformers' packing collators set them), so no document predicts the next."""
    starts = torch.nn.functional.pad(packed.doc_ids[:, 1:] != packed.doc_ids[:, :-1], (1, 0), value=True)
    return input_ids.masked_fill(starts | (packed.doc_ids == 0), IGNORE_INDEX)


def position_ids_from_lengths(lengths: list[int] | tuple[int, ...] | Tensor, device=None) -> Tensor:
    """(1, T) position_ids of documents of `lengths` packed in one row (0..n-1 for each)."""
    sizes = torch.as_tensor(lengths, dtype=torch.long)
    if sizes.dim() != 1 or bool((sizes < 1).any()):
        raise ConfigError(f"document lengths must be positive integers, got {sizes.tolist()}")
    return torch.cat([torch.arange(int(n)) for n in sizes]).to(device)[None]


def lengths_from_cu_seqlens(cu_seqlens: Tensor) -> list[int]:
    """Document lengths from flash-attn-style cumulative offsets (0, n1, n1 + n2, ..., T)."""
    offsets = cu_seqlens.reshape(-1).long().cpu()
    sizes = offsets.diff()
    if offsets.numel() < 2 or int(offsets[0]) != 0 or bool((sizes < 1).any()):
        raise ConfigError(f"cu_seqlens must rise from 0 in positive steps, got {offsets.tolist()}")
    return sizes.tolist()


def attention_flops_fraction(lengths: tuple[tuple[int, ...], ...] | list[list[int]], seq_len: int) -> float:
    """Causal attention work of packed rows relative to unpacked rows of `seq_len` tokens: the sum of the
    documents' squared lengths over seq_len squared, averaged over the rows (padding does no work)."""
    if not lengths:
        return 1.0
    return sum(sum(n * n for n in row) for row in lengths) / (len(lengths) * seq_len * seq_len)


def call_position_ids(call: dict) -> Tensor | None:
    """The position_ids of a model forward call: as given, else from its `cu_seq_lens_q` (one packed row);
    ConfigError when both are given and disagree, or the offsets do not cover the row."""
    position_ids, cu_seqlens = call.get("position_ids"), call.get("cu_seq_lens_q")
    if cu_seqlens is None:
        return position_ids
    from_lengths = position_ids_from_lengths(lengths_from_cu_seqlens(cu_seqlens), device=cu_seqlens.device)
    input_ids = call["input_ids"]
    if input_ids.shape[0] != 1 or from_lengths.shape[1] != input_ids.shape[1]:
        raise ConfigError(f"cu_seq_lens_q {cu_seqlens.tolist()} does not cover input_ids of shape "
                          f"{tuple(input_ids.shape)} (one packed row)")
    if position_ids is None:
        return from_lengths
    same = position_ids.numel() == from_lengths.numel() and torch.equal(
        position_ids.reshape(from_lengths.shape).to(from_lengths.device), from_lengths)
    if not same:
        raise ConfigError("cu_seq_lens_q and position_ids describe different documents")
    return position_ids
