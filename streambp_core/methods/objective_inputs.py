"""Check a batch's objective inputs and build the objective every method shares.

- sft: no extra inputs.
- grpo: `advantages` (B,), `completion_mask` (B, T); optional `old_logps`, `ref_logps` (B, T, indexed like
  input_ids), `beta`, `epsilon`, `epsilon_high`, `loss_type` ('grpo' | 'bnpo' | 'dr_grpo'),
  `max_completion_length`, `temperature` (logits divided by it, as TRL's GRPOTrainer does), `logits_to_keep`
  (TRL's name: the completion is the last `logits_to_keep` tokens; the completion mask is 0 before them).
- dpo: rows 0..P-1 chosen, P..2P-1 rejected; `ref_chosen_logps` (P,), `ref_rejected_logps` (P,), `beta`.
"""

from __future__ import annotations

from typing import Any

from torch import Tensor

from streambp_core.config import ConfigError
from streambp_core.engine.stream.objectives import (
    GRPO_LOSS_TYPES,
    IGNORE_INDEX,
    SFTObjective,
    dpo_objective,
    grpo_objective,
)

GRPO_KEYS = {"advantages", "completion_mask", "old_logps", "ref_logps", "beta", "epsilon", "epsilon_high",
             "loss_type", "max_completion_length", "temperature", "logits_to_keep"}
DPO_KEYS = {"ref_chosen_logps", "ref_rejected_logps", "beta"}


def build_objective(name: str, input_ids: Tensor, labels: Tensor, **inputs: Any):
    """The objective `name` for this batch, or ConfigError naming what is missing or wrong."""
    if name == "sft":
        _no_unknown("sft", inputs, set())
        return SFTObjective.from_labels(labels)
    if name == "grpo":
        return _grpo(input_ids, labels, inputs)
    if name == "dpo":
        return _dpo(input_ids, labels, inputs)
    raise ConfigError(f"unknown objective {name!r}")


def _no_unknown(name: str, inputs: dict, allowed: set) -> None:
    unknown = sorted(set(inputs) - allowed)
    if unknown:
        takes = ", ".join(sorted(allowed)) or "nothing"
        raise ConfigError(f"{name} does not take {', '.join(unknown)}; it takes {takes}")


def _grpo(input_ids: Tensor, labels: Tensor, inputs: dict):
    _no_unknown("grpo", inputs, GRPO_KEYS)
    if inputs.get("advantages") is None:
        raise ConfigError("grpo needs advantages: one scalar per sequence, shape (batch,)")
    rows = input_ids.shape[0]
    if tuple(inputs["advantages"].shape) != (rows,):
        got = tuple(inputs["advantages"].shape)
        raise ConfigError(f"grpo advantages must have shape ({rows},), got {got}")
    completion_mask = inputs.get("completion_mask")
    if completion_mask is None:
        completion_mask = (labels != IGNORE_INDEX).long()
    for key in ("completion_mask", "old_logps", "ref_logps"):
        value = completion_mask if key == "completion_mask" else inputs.get(key)
        if value is not None and value.shape != input_ids.shape:
            raise ConfigError(f"grpo {key} must have the shape of input_ids {tuple(input_ids.shape)}")
    if inputs.get("loss_type", "grpo") not in GRPO_LOSS_TYPES:
        raise ConfigError(f"grpo loss_type must be one of {', '.join(GRPO_LOSS_TYPES)}")
    _check_grpo_scalars(inputs, completion_mask)
    options = {k: v for k, v in inputs.items() if k not in ("advantages", "completion_mask")}
    return grpo_objective(input_ids, completion_mask, inputs["advantages"], **options)


def _check_grpo_scalars(inputs: dict, completion_mask: Tensor) -> None:
    """temperature > 0; logits_to_keep in 1..T-1 with no completion token before the last that many."""
    temperature = inputs.get("temperature", 1.0)
    if not isinstance(temperature, (int, float)) or isinstance(temperature, bool) or not temperature > 0:
        raise ConfigError(f"grpo temperature must be a positive number, got {temperature!r}")
    keep = inputs.get("logits_to_keep")
    if keep is None:
        return
    seq_len = completion_mask.shape[1]
    if not isinstance(keep, int) or isinstance(keep, bool) or not 1 <= keep < seq_len:
        raise ConfigError(f"grpo logits_to_keep must be an integer in 1..{seq_len - 1}, got {keep!r}")
    if completion_mask.device.type != "meta" and bool(completion_mask[:, : seq_len - keep].any()):
        raise ConfigError(f"grpo completion_mask marks tokens before the last logits_to_keep={keep}: the "
                          "completion must be the last logits_to_keep tokens")


def _dpo(input_ids: Tensor, labels: Tensor, inputs: dict):
    _no_unknown("dpo", inputs, DPO_KEYS)
    rows = input_ids.shape[0]
    if rows % 2:
        raise ConfigError(f"dpo needs chosen rows followed by as many rejected rows; got {rows} rows")
    for key in ("ref_chosen_logps", "ref_rejected_logps"):
        value = inputs.get(key)
        if value is None:
            raise ConfigError(f"dpo needs {key}: reference sequence log-probs, shape ({rows // 2},)")
        if tuple(value.shape) != (rows // 2,):
            got = tuple(value.shape)
            raise ConfigError(f"dpo {key} must have shape ({rows // 2},) for {rows} rows, got {got}")
    return dpo_objective(labels, inputs["ref_chosen_logps"], inputs["ref_rejected_logps"],
                         beta=inputs.get("beta", 0.1))
