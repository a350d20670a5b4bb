"""The streamed LM head: final norm (optional), lm_head and objective, `head_partition_size` tokens at a
time, as an autograd.Function so that a plain `loss.backward()` drives it.

Forward (no grad): per chunk, logits (B, c, V) in the objective's precision (float32 for bf16) -> the
objective's token terms -> per-sequence sums S (B,). The loss is `objective.reduce(S)`.
Backward: dL/dS from `reduce`, then per chunk recompute the logits with grad and back-propagate
sum_b dL/dS[b] * S_chunk[b]. Full T x vocab logits never exist; the head's weight gradients accumulate
in `.grad`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streambp_core.engine.chunks import backward_into, chunk_bounds, grad_or_zeros, leaf
from streambp_core.measure.tags import memory_category


@dataclass(frozen=True)
class HeadPlan:
    """The head's modules and chunk size. `norm` is None when the hidden states arrive normed."""

    norm: nn.Module | None
    lm_head: nn.Module
    partition_size: int
    keep_chunks: int | None = None
    """Simulation only: run the first and last `keep_chunks` chunks of each loop (`StreamConfig`)."""


def _chunk_terms(plan: HeadPlan, objective, hidden: Tensor, start: int, end: int) -> Tensor:
    """Token terms (B, c) of hidden positions start..end."""
    h = hidden if plan.norm is None else plan.norm(hidden)
    with memory_category("logits"):
        logits = plan.lm_head(h)
        logits = logits.to(objective.logits_dtype(logits.dtype))
        return objective.token_terms(logits, start, end)


def sequence_stats(plan: HeadPlan, objective, hidden: Tensor) -> Tensor:
    """Per-sequence sums S (B,) of the objective's token terms, without grad, chunk by chunk."""
    stats_dtype = torch.promote_types(hidden.dtype, torch.float32)
    stats = hidden.new_zeros(hidden.shape[0], dtype=stats_dtype)
    for start, end in chunk_bounds(hidden.shape[1], plan.partition_size, plan.keep_chunks):
        stats += _chunk_terms(plan, objective, hidden[:, start:end], start, end).sum(dim=1).to(stats_dtype)
    return stats


def stats_grad(objective, stats: Tensor, grad_loss: Tensor) -> Tensor:
    """dL/dS (B,) of the objective's reduction at S."""
    with torch.enable_grad():
        s = leaf(stats)
        loss = objective.reduce(s)
        (grad,) = torch.autograd.grad(loss, s, grad_loss)
    return grad


class StreamedHead(torch.autograd.Function):
    """autograd.Function: hidden states (B, T, d) -> scalar loss, streamed both ways."""

    @staticmethod
    def forward(ctx, hidden, objective, plan: HeadPlan, *params):
        ctx.objective, ctx.plan, ctx.params = objective, plan, params
        stats = sequence_stats(plan, objective, hidden)
        ctx.save_for_backward(hidden, stats)
        return objective.reduce(stats)

    @staticmethod
    def backward(ctx, grad_loss):
        hidden, stats = ctx.saved_tensors
        plan, objective = ctx.plan, ctx.objective
        d_stats = stats_grad(objective, stats, grad_loss)
        grad_hidden = torch.empty_like(hidden)
        chunk_backward = _linear_chunk_backward if _plain_linear(plan.lm_head) else _autograd_chunk_backward
        for start, end in chunk_bounds(hidden.shape[1], plan.partition_size, plan.keep_chunks):
            h = leaf(hidden[:, start:end])
            chunk_backward(plan, objective, h, start, end, d_stats, ctx.params)
            grad_hidden[:, start:end] = grad_or_zeros(h)
        return (grad_hidden, None, None, *([None] * len(ctx.params)))


def _autograd_chunk_backward(plan, objective, h, start, end, d_stats, params) -> None:
    """Any head (LoRA, bias, ...): recompute the chunk's terms with grad and back-propagate them."""
    with torch.enable_grad():
        weighted = (_chunk_terms(plan, objective, h, start, end).sum(dim=1) * d_stats).sum()
    backward_into([weighted], [torch.ones_like(weighted)], [h], params)


def _linear_chunk_backward(plan, objective, h, start, end, d_stats, params) -> None:
    """A bias-free nn.Linear head, by hand: dW += dlogits^T x in place (one GEMM that accumulates into
    `.grad`, instead of a vocab x hidden temporary per chunk), dx = dlogits W, then the norm by autograd.
    """
    weight = plan.lm_head.weight
    with torch.no_grad():
        x = h if plan.norm is None else plan.norm(h)
        with memory_category("logits"):
            logits = leaf(torch.nn.functional.linear(x, weight))
    with torch.enable_grad(), memory_category("logits"):
        terms = objective.token_terms(logits.to(objective.logits_dtype(logits.dtype)), start, end)
        (d_logits,) = torch.autograd.grad((terms.sum(dim=1) * d_stats).sum(), logits)
    del logits, terms
    d_logits_2d, x_2d = d_logits.flatten(0, 1), x.flatten(0, 1)
    if weight.requires_grad:
        if weight.grad is None:
            weight.grad = torch.zeros_like(weight)
        weight.grad.addmm_(d_logits_2d.t(), x_2d)
    d_x = (d_logits_2d @ weight).view_as(x)
    del d_logits, d_logits_2d
    if plan.norm is None:
        h.grad = d_x
        return
    with torch.enable_grad():
        normed = plan.norm(h)
    backward_into([normed], [d_x], [h], [p for p in params if p is not weight])


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.bias is None
