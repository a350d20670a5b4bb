"""The streamed LM head: final norm (optional), lm_head and objective, `head_partition_size` tokens at a
time, as autograd.Functions so that a plain `loss.backward()` drives them. Full T x vocab logits never
exist. Two forms:

`StreamedHead` (recomputing; any objective, least memory). Forward (no grad): per chunk, logits (B, c, V)
in the objective's precision (float32 for bf16) -> the objective's token terms -> per-sequence sums S (B,).
The loss is `objective.reduce(S)`. Backward: dL/dS from `reduce`, then per chunk recompute the logits with
grad and back-propagate sum_b dL/dS[b] * S_chunk[b]; weight gradients accumulate in `.grad`.

`FusedHead` (objectives whose `reduce` is linear, so dL/dS is known before S: sft, grpo). Forward: per
chunk, the logits once, the token terms and, from the same logits, the chunk's gradients: dL/dlogits,
then dW += dlogits^T x and dx = dlogits W (3 head GEMMs per chunk instead of 4, as Liger's fused linear
cross-entropy). The input gradient and the parameters' gradients wait in the autograd context; backward
scales them by the incoming gradient and only then adds them to `.grad`, so nothing changes `.grad`
before `loss.backward()`. Costs one buffer per head parameter (vocab x hidden for the lm_head) from the
forward to the backward.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.dtypes import at_least_float32
from streambp_core.engine.chunks import backward_into, check_accumulates, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.host.checkpoints import HostChain
from streambp_core.measure.tags import GRADS, memory_category


@dataclass(frozen=True)
class HeadPlan:
    """The head's modules and chunk size. `norm` is None when the hidden states arrive normed."""

    norm: nn.Module | None
    lm_head: nn.Module
    partition_size: int
    keep_chunks: int | None = None
    """Simulation only: run the first and last `keep_chunks` chunks of each loop (`StreamConfig`)."""
    offload: HostChain | None = None
    """Keep the hidden states in host memory between forward and backward (`engine.host.checkpoints`)."""
    logits_scaling: float = 1.0
    """The logits are the lm_head's output divided by it (Granite's `logits_scaling`)."""
    final_softcap: float | None = None
    """The logits are soft-capped, cap * tanh(logits / cap) (Gemma 2's `final_logit_softcapping`)."""

    def scaled(self, logits: Tensor) -> Tensor:
        """The lm_head's output as the model's logits, as transformers computes them: divided by
        `logits_scaling`, then soft-capped by `final_softcap`, in the head's precision."""
        logits = logits if self.logits_scaling == 1.0 else logits / self.logits_scaling
        if self.final_softcap is None:
            return logits
        return torch.tanh(logits / self.final_softcap) * self.final_softcap


def _chunk_terms(plan: HeadPlan, objective, hidden: Tensor, start: int, end: int) -> Tensor:
    """Token terms (B, c) of hidden positions start..end."""
    h = hidden if plan.norm is None else plan.norm(hidden)
    with memory_category("logits"):
        logits = plan.scaled(plan.lm_head(h))
        logits = logits.to(objective.logits_dtype(logits.dtype))
        return objective.token_terms(logits, start, end)


def stats_dtype(objective, dtype: torch.dtype) -> torch.dtype:
    """Precision of the per-sequence sums S a head accumulates chunk by chunk: float64 where the loss is not
    linear in them (dpo: a sigmoid of the difference of two sequences' sums, each about T * ln(vocab), so
    float32's rounding of a long sequence's running sum moves the weight of every token's gradient), the
    working precision (at least float32) where it is (sft, grpo: dL/dS does not depend on S)."""
    work = at_least_float32(dtype)
    return work if objective.linear_reduce else torch.promote_types(work, torch.float64)


def sequence_stats(plan: HeadPlan, objective, hidden: Tensor) -> Tensor:
    """Per-sequence sums S (B,) of the objective's token terms, without grad, chunk by chunk, in
    `stats_dtype`."""
    dtype = stats_dtype(objective, hidden.dtype)
    stats = hidden.new_zeros(hidden.shape[0], dtype=dtype)
    for start, end in chunk_bounds(hidden.shape[1], plan.partition_size, plan.keep_chunks):
        stats += _chunk_terms(plan, objective, hidden[:, start:end], start, end).sum(dim=1).to(dtype)
    return stats


def stats_grad(objective, stats: Tensor, grad_loss: Tensor) -> Tensor:
    """dL/dS (B,) of the objective's reduction at S, in S's precision."""
    with torch.enable_grad():
        s = leaf(stats)
        loss = objective.reduce(s)
        (grad,) = torch.autograd.grad(loss, s, grad_loss.to(loss.dtype))
    return grad


class StreamedHead(torch.autograd.Function):
    """autograd.Function: hidden states (B, T, d) -> scalar loss, streamed both ways."""

    @staticmethod
    def forward(ctx, hidden, objective, plan: HeadPlan, *params):
        ctx.objective, ctx.plan, ctx.params = objective, plan, params
        ctx.host_input = None if plan.offload is None else plan.offload.save(hidden)
        stats = sequence_stats(plan, objective, hidden)
        ctx.save_for_backward(hidden if ctx.host_input is None else None, stats)
        return objective.reduce(stats).to(at_least_float32(hidden.dtype))

    @staticmethod
    def backward(ctx, grad_loss):
        check_accumulates(ctx, "the chunked LM head (streambp, mst)")
        hidden, stats = ctx.saved_tensors
        if ctx.host_input is not None:
            hidden = ctx.host_input.load()
        plan, objective = ctx.plan, ctx.objective
        d_stats = stats_grad(objective, stats, grad_loss).to(at_least_float32(hidden.dtype))
        grad_hidden = torch.empty_like(hidden)
        chunk_backward = _linear_chunk_backward if _plain_linear(plan.lm_head) else _autograd_chunk_backward
        for start, end in chunk_bounds(hidden.shape[1], plan.partition_size, plan.keep_chunks):
            h = leaf(hidden[:, start:end])
            chunk_backward(plan, objective, h, start, end, d_stats, ctx.params)
            grad_hidden[:, start:end] = grad_or_zeros(h)
            if ctx.host_input is not None:
                ctx.host_input.chunk_done(start, end)
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
        scaled = plan.scaled(logits)
        terms = objective.token_terms(scaled.to(objective.logits_dtype(logits.dtype)), start, end)
        (d_logits,) = torch.autograd.grad((terms.sum(dim=1) * d_stats).sum(), logits)
    del logits, scaled, terms
    d_logits_2d, x_2d = d_logits.flatten(0, 1), x.flatten(0, 1)
    if weight.requires_grad:
        if weight.grad is None:
            with memory_category(GRADS):
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


class FusedHead(torch.autograd.Function):
    """autograd.Function: hidden states (B, T, d) -> scalar loss; gradients taken in the forward pass and
    applied, scaled by the incoming gradient, in the backward (see the module docstring)."""

    @staticmethod
    def forward(ctx, hidden, objective, plan: HeadPlan, *params):
        if not objective.linear_reduce:
            raise ConfigError(f"the fused head cannot serve {objective.name}; use head_mode='recompute'")
        ctx.params = params
        stats_dtype = at_least_float32(hidden.dtype)
        d_stats = stats_grad(objective, hidden.new_zeros(hidden.shape[0], dtype=stats_dtype),
                             hidden.new_ones((), dtype=stats_dtype))
        stats, grad_hidden, param_grads = fused_pass(plan, objective, hidden, d_stats, params)
        ctx.save_for_backward(grad_hidden, *param_grads)
        ctx.applied = False
        return objective.reduce(stats)

    @staticmethod
    def backward(ctx, grad_loss):
        check_accumulates(ctx, "streambp's fused LM head")
        if ctx.applied:
            raise RuntimeError("the fused LM head applies its gradients once; use head_mode='recompute' "
                               "to back-propagate through one forward several times")
        ctx.applied = True
        grad_hidden, *param_grads = ctx.saved_tensors
        for param, grad in zip(ctx.params, param_grads, strict=True):
            grad.mul_(grad_loss.to(grad.dtype))
            if param.grad is None:
                param.grad = grad
            else:
                param.grad.add_(grad)
        return (grad_hidden.mul_(grad_loss.to(grad_hidden.dtype)), None, None, *([None] * len(ctx.params)))


NORM_BLOCK_CHUNKS = 16
"""The fused head runs the final norm, and its backward, once per block of this many chunks (a bias-free
linear head): their small ops are dispatched once per block, not per chunk. A block's norm keeps about
3 x d values per token against a chunk's logits' several x vocab, so a block of 16 chunks adds less
memory than one chunk's logits. Blocks lie on the unthinned chunk grid, so a thinned simulation
(`keep_chunks`) holds what the real step holds."""


def fused_pass(plan: HeadPlan, objective, hidden: Tensor, d_stats: Tensor, params):
    """Per-sequence sums S (B,), dL/dhidden and one gradient per parameter, for dL/dS = d_stats, chunk by
    chunk: each chunk's logits are computed once and serve both its loss terms and its gradients."""
    stats = hidden.new_zeros(hidden.shape[0], dtype=at_least_float32(hidden.dtype))
    grad_hidden = torch.empty_like(hidden)
    with memory_category(GRADS):
        param_grads = [torch.zeros_like(p) for p in params]
    chunks = chunk_bounds(hidden.shape[1], plan.partition_size, plan.keep_chunks)
    if not _plain_linear(plan.lm_head):
        for start, end in chunks:
            h = leaf(hidden[:, start:end])
            stats += _fused_autograd_chunk(plan, objective, h, start, end, d_stats, params, param_grads)
            grad_hidden[:, start:end] = grad_or_zeros(h)
        return stats, grad_hidden, param_grads
    block = _LinearBlock(plan, objective, d_stats.to(stats.dtype), params, param_grads)
    for first, last in chunk_bounds(hidden.shape[1], plan.partition_size * NORM_BLOCK_CHUNKS):
        inner = [(start, end) for start, end in chunks if first <= start < last]
        if inner:
            stats += block.run(hidden, first, last, inner, grad_hidden)
    return stats, grad_hidden, param_grads


def _fused_autograd_chunk(plan, objective, h, start, end, d_stats, params, param_grads) -> Tensor:
    """Any head (LoRA, bias, ...): the chunk's terms with grad and their gradients by autograd."""
    with torch.enable_grad():
        sums = _chunk_terms(plan, objective, h, start, end).sum(dim=1)
        wanted = [h, *params]
        grads = torch.autograd.grad((sums * d_stats).sum(), wanted, allow_unused=True)
    h.grad = grads[0]
    _accumulate(param_grads, grads[1:])
    return sums.detach()


class _LinearBlock:
    """A bias-free nn.Linear head, by hand, one block of chunks at a time: the block's norm with grad,
    then per chunk the logits once, dW += dlogits^T x in place and dx = dlogits W; then the block's norm
    backward by autograd, from the chunks' dx."""

    def __init__(self, plan: HeadPlan, objective, d_stats: Tensor, params, param_grads) -> None:
        self.plan, self.objective, self.d_stats = plan, objective, d_stats
        weight = plan.lm_head.weight
        index = {id(p): i for i, p in enumerate(params)}
        self.weight_grad = param_grads[index[id(weight)]] if id(weight) in index else None
        self.norm_params = [p for p in params if p is not weight]
        self.norm_grads = [param_grads[index[id(p)]] for p in self.norm_params]
        self.logits_dtype = objective.logits_dtype(weight.dtype)

    def run(self, hidden: Tensor, first: int, last: int, chunks, grad_hidden: Tensor) -> Tensor:
        """Sums S (B,) of positions first..last (its chunks `chunks`); writes dL/dhidden there."""
        norm = self.plan.norm
        h = leaf(hidden[:, first:last])
        with torch.enable_grad():
            x = h if norm is None else norm(h)
        x_data = x.detach()
        d_x = grad_hidden[:, first:last] if norm is None else torch.empty_like(x_data)
        sums = None
        for start, end in chunks:
            chunk_sums = self._chunk(x_data[:, start - first:end - first], start, end,
                                     d_x[:, start - first:end - first])
            sums = chunk_sums if sums is None else sums.add_(chunk_sums)
        if norm is not None:
            grads = torch.autograd.grad(x, [h, *self.norm_params], d_x, allow_unused=True)
            grad_hidden[:, first:last] = grads[0]
            _accumulate(self.norm_grads, grads[1:])
        return sums

    def _chunk(self, x: Tensor, start: int, end: int, d_x_out: Tensor) -> Tensor:
        """The chunk's sums (B,); its dx written into `d_x_out`, dW accumulated."""
        weight = self.plan.lm_head.weight
        with memory_category("logits"):
            logits = leaf(torch.nn.functional.linear(x, weight))
        with torch.enable_grad(), memory_category("logits"):
            scaled = self.plan.scaled(logits)
            sums = self.objective.token_terms(scaled.to(self.logits_dtype), start, end).sum(dim=1)
            (d_logits,) = torch.autograd.grad(sums, logits, self.d_stats)
        del logits, scaled
        d_logits_2d = d_logits.flatten(0, 1)
        if self.weight_grad is not None:
            self.weight_grad.addmm_(d_logits_2d.t(), x.flatten(0, 1))
        d_x_out.copy_((d_logits_2d @ weight).view_as(x))
        return sums.detach()


def _accumulate(buffers: list[Tensor], grads) -> None:
    for buffer, grad in zip(buffers, grads, strict=True):
        if grad is not None:
            buffer.add_(grad)


def _plain_linear(module: nn.Module) -> bool:
    return type(module) is nn.Linear and module.bias is None
