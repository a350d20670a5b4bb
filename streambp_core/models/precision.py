"""Norms that keep a float64 model in float64.

Gemma 3's RMSNorm computes in `x.float()`, meant as an upcast for bfloat16; on a float64 model it rounds
every norm to float32, and its weight gradient becomes a float32 sum over all tokens, so the model's own
backward is float32-accurate and no float64 comparison of methods can reach 1e-10 on those weights.
`norms_in_at_least_float32` makes each such norm compute in the wider of float32 and its input precision:
for float32, float16 and bfloat16 inputs nothing changes; float64 stays float64.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

FLOAT32_NORMS = ("Gemma3RMSNorm",)
"""Class names of norms that compute in `x.float()`."""


def _norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    work = torch.promote_types(x.dtype, torch.float32)
    return (self._norm(x.to(work)) * (1.0 + self.weight.to(work))).type_as(x)


def norms_in_at_least_float32(model: nn.Module) -> int:
    """Give every float32-only norm of `model` the at-least-float32 forward (instance-level, the class is
    untouched); returns how many norms changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ in FLOAT32_NORMS and "forward" not in vars(module):
            module.forward = types.MethodType(_norm_in_at_least_float32, module)
            changed += 1
    return changed
