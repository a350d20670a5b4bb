"""The optimizer of a training step: none (backprop only) or AdamW over the trainable parameters.

Full-parameter runs are pure bf16 AdamW (states in the parameters' dtype, as the paper's Table 3);
LoRA runs keep fp32 adapters (peft's default upcast) over a bf16 base, so their states are fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from streambp_core.config import OPTIMIZERS, ConfigError


def make_optimizer(model: nn.Module, name: str, *, lr: float = 1e-5) -> torch.optim.Optimizer | None:
    """An optimizer over the parameters that require grad, or None for 'none'."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    if name == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    return torch.optim.AdamW(params, lr=lr, foreach=False)
