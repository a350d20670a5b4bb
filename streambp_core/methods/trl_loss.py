"""GRPO and DPO losses of plain and checkpoint as TRL 0.17's trainers compute them (`baseline_loss="trl"`).

TRL 0.17 (the version the StreamBP paper's Table 3 ran; `trl/trainer/grpo_trainer.py`, `dpo_trainer.py`,
`utils.py` at tag v0.17.0) with its defaults:

- GRPOTrainer `_get_per_token_logps`: the model returns logits for the last `logits_to_keep + 1`
  positions only (`logits_to_keep` = the completion's length), the last one is dropped, the rest are
  divided by the sampling temperature (a new tensor, even at 1), and `selective_log_softmax` takes the
  completion tokens' log-probs; `_compute_loss` then forms the clipped ratio, the k3 KL term and the
  'grpo' / 'bnpo' / 'dr_grpo' normalisation on (B, logits_to_keep) tensors.
- DPOTrainer `concatenated_forward` (`use_logits_to_keep=False`, its default): logits for every
  position of the chosen and rejected rows, `selective_log_softmax` of the next tokens, masked to the
  completion and summed per row; `dpo_loss` (sigmoid) on the sequence log-probs.
- `selective_log_softmax`: in float32/float64 the target logit minus a row-by-row logsumexp; in other
  dtypes a `log_softmax` per row, in the logits' dtype (no float32 copy of the logits).

The value is the objective's (`engine.stream.objectives`), so every method still matches plain. Not emulated:
TRL's metrics (DPO's mean chosen/rejected logits index a copy of the completion logits inside the
forward; GRPO's clip ratios are (B, K)), the reference forward DPOTrainer runs in the step when the
reference log-probs are not precomputed, and the reference model TRL copies for full-parameter training
(here, as in every protocol, reference log-probs are inputs).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import Tensor

from streambp_core.engine.stream.objectives import IGNORE_INDEX, shifted_targets

TRL_VERSION = "0.17.0"
"""The TRL release whose trainers this module follows."""
TRL_GRPO_TEMPERATURE = 0.9
"""GRPOConfig's default sampling temperature in TRL 0.17 (the paper's script kept it)."""


def selective_log_softmax(logits: Tensor, index: Tensor) -> Tensor:
    """log_softmax(logits).gather(index) as TRL 0.17 computes it: (..., V), (...) -> (...)."""
    if logits.dtype in (torch.float32, torch.float64):
        selected = torch.gather(logits, dim=-1, index=index.unsqueeze(-1)).squeeze(-1)
        logsumexp = torch.stack([torch.logsumexp(row, dim=-1) for row in logits])  # row by row
        return selected - logsumexp
    rows = []
    for row_logits, row_index in zip(logits, index, strict=True):  # one row's log-softmax at a time
        row_logps = F.log_softmax(row_logits, dim=-1)
        rows.append(row_logps.gather(dim=-1, index=row_index.unsqueeze(-1)).squeeze(-1))
    return torch.stack(rows)


def grpo_logits_to_keep(input_ids: Tensor, inputs: dict) -> int:
    """Positions whose logits GRPOTrainer computes: `logits_to_keep` when given, else every scored one."""
    return inputs.get("logits_to_keep") or input_ids.shape[1] - 1


def take_logits(outputs: Any) -> Tensor:
    """The logits of a model output, which then holds them no more (TRL keeps only `.logits`)."""
    logits = outputs.logits
    outputs["logits"] = None
    return logits


def grpo_loss(outputs: Any, input_ids: Tensor, inputs: dict[str, Any]) -> Tensor:
    """GRPOTrainer's loss from a model output with the logits of the last `logits_to_keep + 1` positions
    (B, K+1, V), taken out of it: they are freed once divided by the temperature, as in TRL."""
    keep = grpo_logits_to_keep(input_ids, inputs)
    logits = take_logits(outputs)[:, :-1, :][:, -keep:] / inputs.get("temperature", 1.0)
    per_token_logps = selective_log_softmax(logits, input_ids[:, -keep:])
    del logits
    completion_mask = inputs["completion_mask"][:, -keep:]
    old = inputs.get("old_logps")
    old = per_token_logps.detach() if old is None else old[:, -keep:]
    advantages = inputs["advantages"].unsqueeze(1)
    epsilon_low = inputs.get("epsilon", 0.2)
    epsilon_high = epsilon_low if inputs.get("epsilon_high") is None else inputs["epsilon_high"]
    coef_1 = torch.exp(per_token_logps - old)
    coef_2 = torch.clamp(coef_1, 1 - epsilon_low, 1 + epsilon_high)
    per_token_loss = -torch.min(coef_1 * advantages, coef_2 * advantages)
    beta, ref = inputs.get("beta", 0.0), inputs.get("ref_logps")
    if beta != 0.0 and ref is not None:
        ref = ref[:, -keep:]
        per_token_kl = torch.exp(ref - per_token_logps) - (ref - per_token_logps) - 1
        per_token_loss = per_token_loss + beta * per_token_kl
    return _grpo_normalised(per_token_loss, completion_mask, inputs)


def _grpo_normalised(per_token_loss: Tensor, completion_mask: Tensor, inputs: dict) -> Tensor:
    loss_type = inputs.get("loss_type", "grpo")
    if loss_type == "grpo":
        return ((per_token_loss * completion_mask).sum(-1) / completion_mask.sum(-1).clamp(min=1.0)).mean()
    if loss_type == "bnpo":
        return (per_token_loss * completion_mask).sum() / completion_mask.sum().clamp(min=1.0)
    length = inputs.get("max_completion_length") or inputs["completion_mask"].shape[1]
    return (per_token_loss * completion_mask).sum() / (per_token_loss.size(0) * length)


def dpo_loss(logits: Tensor, labels: Tensor, inputs: dict[str, Any]) -> Tensor:
    """DPOTrainer's sigmoid loss from the logits of every position of chosen then rejected rows (the
    caller holds them to the end, as `concatenated_forward` holds the model output)."""
    targets = shifted_targets(labels)  # TRL rolls the ids; the last position predicts nothing here
    loss_mask = targets != IGNORE_INDEX
    per_token_logps = selective_log_softmax(logits, targets.masked_fill(~loss_mask, 0))
    all_logps = per_token_logps.masked_fill(~loss_mask, 0).sum(-1)
    pairs = all_logps.shape[0] // 2
    logratios = all_logps[:pairs] - all_logps[pairs:]
    ref_logratios = inputs["ref_chosen_logps"] - inputs["ref_rejected_logps"]
    return -F.logsigmoid(inputs.get("beta", 0.1) * (logratios - ref_logratios)).mean()
