"""The optimizer of a training step: none (backprop only) or AdamW over the trainable parameters; `adamw`
comes from the package's one AdamW factory (`engine.host.optimizer.adamw`).

Full-parameter runs are pure bf16 AdamW (states in the parameters' dtype, as the paper's Table 3);
LoRA runs keep fp32 adapters (peft's default upcast) over a bf16 base, so their states are fp32.
"""

from __future__ import annotations

import torch
from torch import nn

from streambp_core.config import OPTIMIZERS, ConfigError
from streambp_core.engine.host.optimizer import adamw


def make_optimizer(model: nn.Module, name: str, *, lr: float = 1e-5, on_host: bool = False,
                   ) -> torch.optim.Optimizer | None:
    """`engine.host.optimizer.adamw` over the parameters that require grad (in host memory when
    `on_host`), or None for 'none'."""
    if name not in OPTIMIZERS:
        raise ConfigError(f"unknown optimizer {name!r}; choose from {', '.join(OPTIMIZERS)}")
    if name == "none":
        return None
    params = [p for p in model.parameters() if p.requires_grad]
    if not params:
        raise ConfigError("the model has no trainable parameters")
    return adamw(model, on_host, lr=lr)
