"""Random token batches with right or left padding, for verification and benchmarks."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from streambp_core.config import PADDINGS, ConfigError, require_choice
from streambp_core.engine.stream.objectives import IGNORE_INDEX

PAD_FRACTION = 0.2
"""Average fraction of padded positions when padding is on; rows get different amounts."""

@dataclass(frozen=True, kw_only=True)
class Batch:
    """Inputs of one training step: token ids, attention mask (None without padding) and labels."""

    input_ids: torch.Tensor
    """[batch, seq_len] int64 token ids."""

    attention_mask: torch.Tensor | None
    """[batch, seq_len] int64, 1 for real tokens and 0 for padding; None when nothing is padded."""

    labels: torch.Tensor
    """[batch, seq_len] int64: `input_ids` with padded positions set to -100."""

    position_ids: torch.Tensor | None = None
    """[batch, seq_len] int64 positions restarting at 0 for each packed document; None: 0..T-1."""

    @property
    def valid_tokens(self) -> int:
        """Number of non-padded positions in the whole batch."""
        return int((self.labels != IGNORE_INDEX).sum())


def padding_lengths(seq_len: int, batch_size: int) -> list[int]:
    """Padded positions per row: about 20% on average, spread from ~10% to ~30% across the rows.

    Each row keeps at least two real tokens, so every row has at least one target after the shift.
    """
    if batch_size == 1:
        fractions = [PAD_FRACTION]
    else:
        fractions = [PAD_FRACTION * (0.5 + row / (batch_size - 1)) for row in range(batch_size)]
    most = max(seq_len - 2, 0)
    return [min(max(round(fraction * seq_len), 1), most) for fraction in fractions]


def _mask(seq_len: int, pad_lengths: list[int], side: str) -> torch.Tensor:
    positions = torch.arange(seq_len).unsqueeze(0)  # [1, T]
    pads = torch.tensor(pad_lengths).unsqueeze(1)  # [B, 1]
    padded = positions >= seq_len - pads if side == "right" else positions < pads
    return (~padded).long()


def random_batch(
    *,
    vocab_size: int,
    seq_len: int,
    batch_size: int,
    padding: str = "none",
    seed: int = 0,
    device: str | torch.device = "cpu",
) -> Batch:
    """Uniformly random token ids (drawn on the CPU, so the same seed gives the same batch on any device).

    With `padding` "right" or "left", about 20% of the positions are padding (different per row),
    masked in `attention_mask` and set to -100 in `labels`.
    """
    require_choice("padding", padding, PADDINGS)
    generator = torch.Generator().manual_seed(seed)
    input_ids = torch.randint(0, vocab_size, (batch_size, seq_len), generator=generator)
    labels = input_ids.clone()
    attention_mask = None
    if padding != "none":
        attention_mask = _mask(seq_len, padding_lengths(seq_len, batch_size), padding)
        input_ids = input_ids.masked_fill(attention_mask == 0, 0)
        labels = labels.masked_fill(attention_mask == 0, IGNORE_INDEX)
    to = {"device": device}
    mask = None if attention_mask is None else attention_mask.to(**to)
    return Batch(input_ids=input_ids.to(**to), attention_mask=mask, labels=labels.to(**to))


def meta_batch(batch_size: int, seq_len: int) -> Batch:
    """A batch of token ids on the meta device (shapes only, no padding): a simulated step's inputs, which
    cost no host memory whatever their length."""
    input_ids = torch.empty((batch_size, seq_len), dtype=torch.long, device="meta")
    return Batch(input_ids=input_ids, attention_mask=None, labels=input_ids.clone())


def objective_inputs(objective: str, batch: Batch, seed: int = 0) -> tuple[torch.Tensor, dict]:
    """Labels and extra inputs of a synthetic `objective` step on `batch` (random but fixed by `seed`).

    The first quarter of each row is the prompt. grpo: one advantage per row (a group), the prompt out of
    the completion mask (the completion: the last `logits_to_keep` tokens), reference log-probs for a k3
    KL term (beta 0.04). dpo: rows 0..B/2-1 chosen, B/2..B-1 rejected, prompt labels ignored, reference
    sequence log-probs, beta 0.1.
    """
    generator = torch.Generator().manual_seed(seed + 7)
    device = batch.input_ids.device
    rows, seq_len = batch.input_ids.shape
    labels = batch.labels.clone()
    labels[:, : seq_len // 4] = IGNORE_INDEX
    if objective == "sft":
        return batch.labels, {}
    if objective == "grpo":
        advantages = torch.randn(rows, generator=generator)
        ref = (torch.empty(rows, seq_len, device="meta") if device.type == "meta"
               else -10.0 - 4.0 * torch.rand(rows, seq_len, generator=generator))
        inputs = {"advantages": advantages.to(device), "completion_mask": (labels != IGNORE_INDEX).long(),
                  "ref_logps": ref.to(device), "beta": 0.04, "logits_to_keep": seq_len - seq_len // 4}
        return labels, inputs
    if objective == "dpo":
        if rows % 2:
            raise ConfigError(f"dpo needs an even batch (chosen rows then rejected rows), got {rows}")
        noise = torch.randn(rows, generator=generator).to(device)
        ref = -12.0 * (labels != IGNORE_INDEX).sum(dim=1).float() + noise
        inputs = {"ref_chosen_logps": ref[: rows // 2], "ref_rejected_logps": ref[rows // 2:], "beta": 0.1}
        return labels, inputs
    raise ConfigError(f"unknown objective {objective!r}")


def document_lengths(text: str, seq_len: int, rows: int, seed: int = 0) -> list[list[int]]:
    """Each row's packed document lengths from `--packing` text: "N" for N random lengths that fill the
    row (different per row, fixed by `seed`), or "a,b,c" for those lengths in every row (a shorter total
    leaves trailing padding). ConfigError for text that is neither or lengths that do not fit."""
    parts = [p.strip() for p in text.split(",")]
    if not all(p.isdigit() and int(p) > 0 for p in parts):
        raise ConfigError(f"--packing takes a document count or lengths like 100,37,250, got {text!r}")
    if len(parts) > 1:
        lengths = [int(p) for p in parts]
        if sum(lengths) > seq_len:
            raise ConfigError(f"--packing lengths {text} sum to {sum(lengths)} > seq_len {seq_len}")
        return [lengths] * rows
    count = int(parts[0])
    if count > seq_len:
        raise ConfigError(f"--packing {count} documents do not fit in seq_len {seq_len}")
    generator = torch.Generator().manual_seed(seed + 11)
    result = []
    for _ in range(rows):
        cuts = (torch.randperm(seq_len - 1, generator=generator)[: count - 1] + 1).sort().values.tolist()
        result.append([b - a for a, b in zip([0, *cuts], [*cuts, seq_len], strict=True)])
    return result


def pack_rows(batch: Batch, lengths: list[list[int]]) -> Batch:
    """`batch` as packed rows of documents with `lengths` per row: positions restart at 0 for each
    document, each document's first label is ignored (as TRL's packing collator sets it), and positions
    past a row's documents are trailing padding."""
    rows, seq_len = batch.input_ids.shape
    positions = torch.zeros(rows, seq_len, dtype=torch.long)
    starts = torch.zeros(rows, seq_len, dtype=torch.bool)
    mask = torch.zeros(rows, seq_len, dtype=torch.long)
    for row, row_lengths in enumerate(lengths):
        offset = 0
        for n in row_lengths:
            positions[row, offset:offset + n] = torch.arange(n)
            starts[row, offset], offset = True, offset + n
        mask[row, :offset] = 1
    device = batch.input_ids.device
    mask, starts = mask.to(device), starts.to(device)
    labels = batch.input_ids.masked_fill(starts | (mask == 0), IGNORE_INDEX)
    padded = not bool(mask.all())
    return Batch(input_ids=batch.input_ids, attention_mask=mask if padded else None, labels=labels,
                 position_ids=positions.to(device))
