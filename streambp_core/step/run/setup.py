"""A step's setup: `StepSpec` -> the model (random weights, LoRA), its optimizer, and the step's inputs.

Protocol of a step (the same simulated and measured):
1. Model in `dtype` with seeded random weights (bfloat16: pure-bf16 AdamW for full parameters); LoRA
   (`lora_rank` > 0) via peft on every linear layer, alpha 4 x rank (fp32 adapters over the base).
2. With an optimizer its state exists before the step (a steady-state step: AdamW's two moments per
   trainable parameter) and gradients do not (`grads` fresh); without one, zero gradients exist before
   the step (`grads` resident: a gradient-accumulation micro-step) unless `grads` is fresh.
3. Inputs: `spec.sequences` rows of random tokens, no padding. A backprop-only SFT step passes the ids
   alone (labels are the inputs, made inside the step); a training step passes labels and the
   objective's inputs from `streambp_core.step.parts.batch.objective_inputs` (first quarter of each row the
   prompt; reference log-probs are inputs: no reference model). GRPO's completion is the last three quarters
   (`logits_to_keep`); under the trl protocol its logits are divided by TRL's sampling temperature.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from transformers import PretrainedConfig

from streambp_core.config import ConfigError, StepSpec, require_sized
from streambp_core.methods.trl_loss import TRL_GRPO_TEMPERATURE
from streambp_core.models.load import build_model
from streambp_core.models.lora import apply_lora
from streambp_core.step.parts.batch import meta_batch, objective_inputs, random_batch
from streambp_core.step.parts.host_pool import device_resident, step_optimizer


@dataclass(frozen=True, kw_only=True)
class Setup:
    """What one step of `spec` runs on: the model, its optimizer (or None) and `run.loss` keyword inputs."""

    spec: StepSpec
    config: PretrainedConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer | None
    inputs: dict


def torch_dtype(name: str) -> torch.dtype:
    """'bfloat16' -> torch.bfloat16 (names as `config.DTYPES`)."""
    value = getattr(torch, name, None)
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ConfigError(f"unknown dtype {name!r}; use bfloat16, float16, float32 or float64")
    return value


def build_training_model(
    spec: StepSpec, config: PretrainedConfig, device: str,
    wrap: Callable[[torch.nn.Module], torch.nn.Module] | None = None,
) -> tuple[torch.nn.Module, torch.optim.Optimizer | None]:
    """The (LoRA-wrapped) model on `device` and its optimizer with state initialised (protocol 1-2);
    `wrap` (e.g. sharding) applies to the model before its optimizer is made. `config` is validated
    (`ResolvedModel.config`, `load_config`): the build trusts it."""
    model = build_model(config, dtype=torch_dtype(spec.dtype), device=device, seed=spec.seed, checked=True)
    if spec.lora_rank:
        model = apply_lora(model, spec.lora_rank)
    if wrap is not None:
        model = wrap(model)
    optimizer = step_optimizer(model, spec)
    if optimizer is not None:
        for param in model.parameters():
            if param.requires_grad:
                param.grad = torch.zeros_like(param)
        optimizer.step()  # creates the AdamW moments (zero grads: the weights stay as they are)
    reset_grads(model, spec)
    return model, optimizer


def reset_grads(model: torch.nn.Module, spec: StepSpec) -> None:
    """Gradients as the step starts: zeros for every trainable parameter (resident) or None (fresh)."""
    for param in model.parameters():
        resident = spec.grads == "resident" and param.requires_grad
        param.grad = torch.zeros_like(param) if resident else None


def step_inputs(spec: StepSpec, vocab_size: int, device: str) -> dict:
    """Keyword arguments of `run.loss` for one step of `spec` (protocol 3)."""
    if device == "meta":  # shapes only: no host memory in proportion to the length
        batch = meta_batch(spec.sequences, spec.seq_len_tokens)
    else:
        batch = random_batch(vocab_size=vocab_size, seq_len=spec.seq_len_tokens, batch_size=spec.sequences,
                             seed=spec.seed + 1, device="cpu")
    if not spec.is_training_step:
        return {"input_ids": batch.input_ids.to(device)}
    labels, extra = objective_inputs(spec.objective, batch, spec.seed)
    if spec.protocol == "trl" and spec.objective == "grpo":
        extra["temperature"] = TRL_GRPO_TEMPERATURE
    moved = {k: v.to(device) if isinstance(v, torch.Tensor) else v for k, v in extra.items()}
    return {"input_ids": batch.input_ids.to(device), "labels": labels.to(device), **moved}


def build_setup(
    spec: StepSpec, config: PretrainedConfig, device: str, *, model: torch.nn.Module | None = None,
    optimizer: torch.optim.Optimizer | None = None,
) -> Setup:
    """The setup of one step of `spec` on `device`; pass `model` (and its `optimizer`) to reuse them
    across lengths (a measured search builds the model once), their gradients reset for this step."""
    require_sized(spec.stream)
    if model is None:
        model, optimizer = build_training_model(spec, config, device)
    else:
        reset_grads(model, spec)
    inputs = step_inputs(spec, config.vocab_size, device)
    return Setup(spec=spec, config=config, model=model, optimizer=optimizer, inputs=inputs)


def resident_bytes(spec: StepSpec, config: PretrainedConfig) -> int:
    """Bytes every step of `spec` holds whatever its length: the weights, a gradient per trainable
    parameter and the optimizer's state (counted on a meta model, LoRA included); one rank's when the
    step is sharded."""
    model, optimizer = build_training_model(spec, config, "meta")
    params = list(model.parameters())
    trainable = sum(p.nbytes for p in params if p.requires_grad)
    state = 0 if optimizer is None else sum(
        t.nbytes for s in optimizer.state.values() for t in s.values() if isinstance(t, torch.Tensor))
    if hasattr(optimizer, "remove_hooks"):
        optimizer.remove_hooks()
    held = {"weights": sum(p.nbytes for p in params), "grads": trainable, "optimizer": state}
    if spec.shard != "none":  # one rank's: its shards (and what DeepSpeed ZeRO-2 keeps whole)
        from streambp_core.step.parts.shards import ShardLayout, rank_breakdown

        phase = "forward" if spec.shard.startswith("deepspeed-") else "optimizer"
        held = rank_breakdown(spec, ShardLayout.from_model(model, spec.gpus), held, phase)
        if spec.shard == "deepspeed-zero3":  # its layout knows DeepSpeed's offload sections
            return sum(held.values())
    return sum(device_resident(spec, held).values())
