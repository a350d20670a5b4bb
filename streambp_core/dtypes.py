"""The one precision rule the engine and its models share: compute in at least float32.

A reduction, a softmax, a norm or an optimizer state computes in the wider of float32 and its input's
precision: bfloat16 and float16 inputs widen to float32 (transformers' `.float()` islands), float32 stays
float32, and float64 stays float64, so a float64 model's gradients can be compared with plain's to
1e-12. Pure torch dtypes, no tensors.
"""

from __future__ import annotations

import torch

FLOAT32_BYTES = 4
"""Bytes of one float32 element: the widened islands, master weights and optimizer moments are float32."""


def at_least_float32(dtype: torch.dtype) -> torch.dtype:
    """The wider of float32 and `dtype` (float64 stays float64; half precisions widen to float32)."""
    return torch.promote_types(dtype, torch.float32)
