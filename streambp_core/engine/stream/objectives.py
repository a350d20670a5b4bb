"""Training objectives in the streamed form: loss = reduce(S), S[b] = sum over tokens of token terms.

Every objective splits into (1) per-token terms that need only one chunk of logits and per-token inputs
fixed before the step, summed into per-sequence statistics S (B,), and (2) a small `reduce(S)` that may be
non-linear (DPO). The head runs a no-grad pass for S, then dL/dS from `reduce`, then a chunked backward
of sum_b dL/dS[b] * S[b] (as in the StreamBP paper, arXiv 2506.03077). For SFT this is the usual mean
token cross-entropy; the same code path serves every method, so the objectives are defined once.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from streambp_core.dtypes import at_least_float32

IGNORE_INDEX = -100
"""Label value that no loss counts (transformers' causal-LM loss ignores it too): padding, prompts."""


def shifted_targets(labels: Tensor) -> Tensor:
    """Targets (B, T): position t predicts labels[t + 1]; the last position predicts nothing (-100)."""
    return F.pad(labels[:, 1:], (0, 1), value=IGNORE_INDEX)


def default_labels(input_ids: Tensor, attention_mask: Tensor | None) -> Tensor:
    """Labels when none are given: the inputs, with padding positions ignored."""
    if attention_mask is None:
        return input_ids
    return input_ids.masked_fill(attention_mask == 0, IGNORE_INDEX)


def token_cross_entropy(logits: Tensor, targets: Tensor) -> Tensor:
    """-log p(target) per token (B, c) from logits (B, c, V); 0 where the target is ignored."""
    ce = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE_INDEX, reduction="none")
    return ce.view(targets.shape)


def token_logprobs(logits: Tensor, targets: Tensor) -> Tensor:
    """log p(target) per token (B, c) from logits (B, c, V); 0 where the target is ignored."""
    return -token_cross_entropy(logits, targets)


@dataclass(frozen=True, eq=False)
class SFTObjective:
    """Mean token cross-entropy over valid (label != -100) shifted targets of the whole batch.

    Matches transformers' causal-LM loss, which computes it on float32 logits; float64 logits keep float64.
    """

    targets: Tensor  # (B, T) shifted labels

    name = "sft"
    linear_reduce = True
    """`reduce` is linear in S, so dL/dS is known before S is: the head can take gradients in its forward."""

    logits_dtype = staticmethod(at_least_float32)

    @classmethod
    def from_labels(cls, labels: Tensor) -> SFTObjective:
        return cls(targets=shifted_targets(labels))

    def token_terms(self, logits: Tensor, start: int, end: int) -> Tensor:
        """Per-token cross-entropy (B, c) for positions start..end."""
        return token_cross_entropy(logits, self.targets[:, start:end])

    def reduce(self, stats: Tensor) -> Tensor:
        """Sum of per-sequence cross-entropy sums over the number of valid targets."""
        num_valid = (self.targets != IGNORE_INDEX).sum()
        return stats.sum() / num_valid


GRPO_LOSS_TYPES = ("grpo", "bnpo", "dr_grpo")


def shifted_per_token(values: Tensor) -> Tensor:
    """Per-token inputs indexed by the token they score (like labels) -> indexed by predicting position."""
    return F.pad(values[:, 1:], (0, 1), value=0)


@dataclass(frozen=True, eq=False)
class GRPOObjective:
    """Clipped policy-gradient loss with one advantage per sequence and an optional k3 KL penalty.

    Per completion token: -min(r * A, clip(r, 1 - eps_low, 1 + eps_high) * A) + beta * k3, where
    r = exp(logp - old_logp) and k3 = exp(ref - logp) - (ref - logp) - 1. Normalisations follow TRL's GRPO:
    'grpo' averages each sequence over its completion tokens then over sequences; 'bnpo' averages over all
    completion tokens of the batch; 'dr_grpo' divides by batch size x `max_completion_length`. logp is
    taken from the logits divided by `temperature` (TRL's sampling temperature; 1 leaves them as they are).
    """

    targets: Tensor  # (B, T) token predicted at each position, -100 where nothing is predicted
    weights: Tensor  # (B, T) completion mask times the normalisation, by predicting position
    advantages: Tensor  # (B,)
    old_logps: Tensor | None  # (B, T) by predicting position; None: on-policy (r = 1, grad of r = grad logp)
    ref_logps: Tensor | None
    beta: float
    epsilon_low: float
    epsilon_high: float
    temperature: float = 1.0

    name = "grpo"
    linear_reduce = True
    logits_dtype = staticmethod(at_least_float32)

    def token_terms(self, logits: Tensor, start: int, end: int) -> Tensor:
        if self.temperature != 1.0:
            logits = logits / self.temperature
        logp = token_logprobs(logits, self.targets[:, start:end])
        old = logp.detach() if self.old_logps is None else self.old_logps[:, start:end]
        ratio = torch.exp(logp - old)
        adv = self.advantages[:, None].to(ratio.dtype)
        clipped = torch.clamp(ratio, 1 - self.epsilon_low, 1 + self.epsilon_high)
        per_token = -torch.minimum(ratio * adv, clipped * adv)
        if self.beta and self.ref_logps is not None:
            delta = self.ref_logps[:, start:end] - logp
            per_token = per_token + self.beta * (torch.exp(delta) - delta - 1)
        return per_token * self.weights[:, start:end].to(per_token.dtype)

    def reduce(self, stats: Tensor) -> Tensor:
        return stats.sum()


def grpo_objective(input_ids: Tensor, completion_mask: Tensor, advantages: Tensor, *,
                   old_logps: Tensor | None = None, ref_logps: Tensor | None = None, beta: float = 0.0,
                   epsilon: float = 0.2, epsilon_high: float | None = None, loss_type: str = "grpo",
                   max_completion_length: int | None = None, temperature: float = 1.0,
                   logits_to_keep: int | None = None) -> GRPOObjective:
    """Build the GRPO objective. Per-token tensors (B, T) are indexed like input_ids: entry j scores
    token j. `completion_mask` marks completion tokens (prompt and padding 0); `logits_to_keep` (the
    completion's length, the last columns; checked by `methods.objective_inputs`) changes no value.
    Weights are kept in float64 and cast to the per-token terms' dtype (exact normalisers in float64)."""
    mask = shifted_per_token(completion_mask.to(torch.float64))
    weights = mask * _grpo_normaliser(mask, loss_type, max_completion_length)
    targets = shifted_targets(input_ids.masked_fill(completion_mask == 0, IGNORE_INDEX))
    return GRPOObjective(
        targets=targets, weights=weights, advantages=advantages,
        old_logps=None if old_logps is None else shifted_per_token(old_logps),
        ref_logps=None if ref_logps is None else shifted_per_token(ref_logps),
        beta=beta, epsilon_low=epsilon, epsilon_high=epsilon if epsilon_high is None else epsilon_high,
        temperature=temperature,
    )


def _grpo_normaliser(mask: Tensor, loss_type: str, max_completion_length: int | None) -> Tensor:
    """Per-position factor (B, 1) or scalar that turns masked token sums into TRL's loss."""
    if loss_type == "grpo":
        return 1.0 / (mask.sum(dim=1, keepdim=True).clamp(min=1.0) * mask.shape[0])
    if loss_type == "bnpo":
        return 1.0 / mask.sum().clamp(min=1.0)
    if loss_type == "dr_grpo":
        length = max_completion_length or mask.shape[1]
        return mask.new_tensor(1.0 / (mask.shape[0] * length))
    raise ValueError(f"unknown GRPO loss_type {loss_type!r}; choose from {', '.join(GRPO_LOSS_TYPES)}")


@dataclass(frozen=True, eq=False)
class DPOObjective:
    """Sigmoid DPO: mean over pairs of -log sigmoid(beta * ((lp_w - ref_w) - (lp_l - ref_l))).

    Rows 0..P-1 of the batch are the chosen completions, rows P..2P-1 the rejected ones, pair i = (i, P+i).
    Sequence log-probs lp sum the log-probs of label tokens (prompt and padding labelled -100).
    Not separable over tokens: the head's no-grad pass gives lp, `reduce` gives dL/dlp, then the chunked
    backward weights each sequence's tokens by it.
    """

    targets: Tensor  # (2P, T)
    ref_chosen_logps: Tensor  # (P,)
    ref_rejected_logps: Tensor  # (P,)
    beta: float

    name = "dpo"
    linear_reduce = False
    logits_dtype = staticmethod(at_least_float32)

    def token_terms(self, logits: Tensor, start: int, end: int) -> Tensor:
        return token_logprobs(logits, self.targets[:, start:end])

    def reduce(self, stats: Tensor) -> Tensor:
        pairs = stats.shape[0] // 2
        chosen, rejected = stats[:pairs], stats[pairs:]
        ref_chosen = self.ref_chosen_logps.to(stats.dtype)
        ref_rejected = self.ref_rejected_logps.to(stats.dtype)
        margin = (chosen - ref_chosen) - (rejected - ref_rejected)
        return -F.logsigmoid(self.beta * margin).mean()


LINEAR_REDUCE_OBJECTIVES = tuple(cls.name for cls in (SFTObjective, GRPOObjective, DPOObjective)
                                 if cls.linear_reduce)
"""Objectives whose loss is linear in the per-sequence sums, as the classes say (`linear_reduce`): what
`config.FUSED_HEAD_OBJECTIVES` states without torch, where the head mode is resolved."""


def dpo_objective(labels: Tensor, ref_chosen_logps: Tensor, ref_rejected_logps: Tensor, *,
                  beta: float = 0.1) -> DPOObjective:
    """Build the DPO objective for a batch of chosen rows followed by as many rejected rows."""
    return DPOObjective(targets=shifted_targets(labels), ref_chosen_logps=ref_chosen_logps,
                        ref_rejected_logps=ref_rejected_logps, beta=beta)
