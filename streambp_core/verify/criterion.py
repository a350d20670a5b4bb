"""How `verify` judges a method against plain: the precisions it checks, the fixed bounds of float64 and
float32, the statement of the criterion, and the low-precision rule's factor and slacks (flash-attention's:
a bfloat16 or float16 method passes when its error is at most twice plain's in the same precision against a
float32 reference)."""

from __future__ import annotations

import torch

DTYPES = {"float64": torch.float64, "float32": torch.float32, "bfloat16": torch.bfloat16,
          "float16": torch.float16}
TOLERANCE = {"float64": 1e-10, "float32": 1e-4}
"""Largest accepted gradient error (CRITERION) and loss error relative to max(1, |loss|), per dtype."""

CRITERION = (
    "per parameter ||g - g_plain|| <= rtol * (||g_plain|| + sqrt(numel) * rms), rms = RMS of plain's "
    "gradient over all parameters (assert_close's atol + rtol, in norms); loss: |l - l_plain| <= "
    "loss tolerance"
)
"""How a method's gradients and loss are judged, as the report states it."""


LOW_PRECISION_FACTOR = 2.0
"""bfloat16, float16: a method may be this many times as far from the fp32 reference as plain is in the
same precision."""

LOW_PRECISION_EPS = 1e-6
"""bfloat16, float16: absolute slack on the gradient bound, so a zero baseline error does not demand
exactness."""

LOW_PRECISION_LOSS_EPS = 2.0**-10
"""bfloat16, float16: slack on the loss bound relative to max(1, |loss|) (1/8 of bf16's epsilon, 2x
float16's): one scalar's baseline error can be near zero by chance, unlike the max over many gradient
elements."""
