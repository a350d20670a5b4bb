"""The host pool of a step with offload tiers (`streambp_core.tiers`): its optimizer, what it holds in host
memory whatever the length, and what stays resident on the device.

Protocol of a step with the optimizer tier: `HostAdamW` (lr 1e-5, as `streambp_core.step.parts.optim`) with
its masters (the parameters' dtype promoted to float32) and moments in host memory; each gradient goes to the
host as it is complete. With the params tier every weight lives in host memory and the device holds the
gathered units only (about two decoder layers, or a layer and the embedding or head).
"""

from __future__ import annotations

import torch
from transformers import PretrainedConfig

from streambp_core.config import StepSpec
from streambp_core.dtypes import at_least_float32
from streambp_core.step.parts.optim import make_optimizer

STEP_LR = 1e-5
"""The learning rate of a step's optimizer (`streambp_core.step.parts.optim.make_optimizer`'s)."""


def step_optimizer(model: torch.nn.Module, spec: StepSpec) -> torch.optim.Optimizer | None:
    """The step's optimizer (`optim.make_optimizer`): in host memory (`HostAdamW`) with the optimizer tier."""
    on_host = spec.offload.optimizer
    return make_optimizer(model, "adamw" if on_host else spec.optimizer, lr=STEP_LR, on_host=on_host)


def host_pool_tensors(run, optimizer) -> list[torch.Tensor]:
    """What a prepared run and its optimizer hold in host memory before the step (params tier's weights,
    the host optimizer's masters and moments), for the tracker's host pool."""
    tensors = [] if run.host_params is None else run.host_params.host_tensors()
    if hasattr(optimizer, "host_tensors"):
        tensors += optimizer.host_tensors()
    return tensors


def device_resident(spec: StepSpec, held: dict[str, int]) -> dict[str, int]:
    """`held` (weights, grads, optimizer bytes a step holds whatever its length) less what the tiers keep
    on the host: weights with params; gradients (sent as each is complete) and states with optimizer."""
    tiers = spec.offload
    return {name: 0 if (name == "weights" and tiers.params)
            or (name in ("grads", "optimizer") and tiers.optimizer) else nbytes
            for name, nbytes in held.items()}


def host_resident_bytes(spec: StepSpec, config: PretrainedConfig) -> dict[str, int]:
    """Bytes the tiers hold in host memory whatever the length (counted on a meta model, LoRA included):
    'weights' (params tier), 'optimizer' (optimizer tier: masters + two AdamW moments per trainable
    parameter, in its dtype promoted to float32). Gradients in flight and checkpoints come on top."""
    from streambp_core.models.load import build_model
    from streambp_core.models.lora import apply_lora

    tiers = spec.offload
    model = build_model(config, dtype=getattr(torch, spec.dtype), device="meta", seed=spec.seed)
    if spec.lora_rank:
        model = apply_lora(model, spec.lora_rank)
    params = list(model.parameters())
    master = sum(p.numel() * at_least_float32(p.dtype).itemsize
                 for p in params if p.requires_grad)
    return {"weights": sum(p.nbytes for p in params) if tiers.params else 0,
            "optimizer": 3 * master if tiers.optimizer and spec.optimizer != "none" else 0}
