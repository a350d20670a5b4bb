"""Attention sinks (gpt-oss): one learned logit per query head that joins every query row's softmax
denominator and attends to nothing.

With s_j = scale * q . k_j over the keys a row sees and the head's sink logit z:
  L = log(exp(z) + sum_j exp(s_j)),  p_j = exp(s_j - L),  O = sum_j p_j v_j.
1. A kernel without sinks gives O' and L' = logsumexp_j s_j; then L = logaddexp(L', z) and
   O = O' * exp(L' - L) (`fold_sinks`): the sink only rescales each row.
2. The backward of (q, k, v) is softmax attention's with that L: P recomputed as exp(S - L) and
   dS = P * (dP - D), D = rowsum(dO * O), so any kernel whose backward takes the log-sum-exp and the
   output (flash's, the CPU op's) takes the sink through them.
3. The sink's own gradient: dL/dz = sum over rows of p_z * (0 - D), p_z = exp(z - L) (`sink_grad`); a
   row that sees no key has O = 0, so D = 0 and it adds nothing, as in transformers' eager attention.
"""

from __future__ import annotations

import torch
from torch import Tensor


def fold_sinks(out: Tensor, lse: Tensor, sinks: Tensor) -> tuple[Tensor, Tensor]:
    """Step 1: the output (B, c, H, hd) and log-sum-exp (B, H, c) of attention without sinks -> those with
    the sinks (H,) in every row's denominator (the output in its own precision, L in the lse's)."""
    with_sink = torch.logaddexp(lse, sinks.to(lse.dtype)[None, :, None])
    keep = torch.exp(lse - with_sink).transpose(1, 2)[..., None]  # (B, c, H, 1)
    return (out.to(lse.dtype) * keep).to(out.dtype), with_sink


def sink_grad(grad_out: Tensor, out: Tensor, lse: Tensor, sinks: Tensor) -> Tensor:
    """Step 3: dL/d sinks (H,) from the output's gradient and the output (B, H, c, hd), and the
    log-sum-exp (B, H, c), the sink included."""
    work = lse.dtype
    row_dot = (grad_out.to(work) * out.to(work)).sum(dim=-1)  # D, (B, H, c)
    p_sink = torch.exp(sinks.to(work)[None, :, None] - lse)
    return -(p_sink * row_dot).sum(dim=(0, 2)).to(sinks.dtype)
