"""Training objectives in the streamed form: loss = reduce(S), S[b] = sum over tokens of token terms.

Every objective splits into (1) per-token terms that need only one chunk of logits and per-token inputs
fixed before the step, summed into per-sequence statistics S (B,), and (2) a small `reduce(S)` that may be
non-linear (DPO). The head runs a no-grad pass for S, then dL/dS from `reduce`, then a chunked backward
of sum_b dL/dS[b] * S[b] (PAPER.md section 1, "Objectives"). For SFT this is the usual mean token
cross-entropy; the same code path serves every method, so the objectives are defined once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch.nn.functional as F
from torch import Tensor

IGNORE_INDEX = -100


def shifted_targets(labels: Tensor) -> Tensor:
    """Targets (B, T): position t predicts labels[t + 1]; the last position predicts nothing (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def default_labels(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Labels when none are given: the inputs, with padding positions ignored."""
    if attention_mask is None:
        return input_ids
    return input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per token (B, c) from logits (B, c, V); 0 where the target is ignored."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return -ce.view(targets.shape)


@dataclass(frozen=True, eq=False)
class SFTObjective:
    """Mean token cross-entropy over valid (label != -100) shifted targets of the whole batch.

    Matches transformers' causal-LM loss, which computes it on float32 logits.
    """

    targets: Tensor  # (B, T) shifted labels

    name = "sft"

    @classmethod
    def from_labels(cls, labels: Tensor) -> SFTObjective:
        return cls(targets=shifted_targets(labels))

    def token_terms(self, logits: Tensor, start: int, end: int) -> Tensor:
        """Per-token cross-entropy (B, c) of float32 logits for positions start..end."""
        return -token_logprobs(logits, self.targets[:, start:end])

    def reduce(self, stats: Tensor) -> Tensor:
        """Sum of per-sequence cross-entropy sums over the number of valid targets."""
        num_valid = (self.targets != IGNORE_INDEX).sum()
        return stats.sum() / num_valid
