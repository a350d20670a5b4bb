"""The MLP run in sequence chunks both ways (Mini-Sequence Transformer, arXiv 2407.15892).

Forward keeps only the MLP input; backward recomputes one chunk at a time, so the (c, intermediate)
activations of only one chunk are alive. Weight gradients accumulate in `.grad`. A chunk reaches the MLP
as a dense (B, c, d) tensor (a mixture-of-experts block views its input as (B * c, d)). An MLP that
returns (output, router scores) (gpt-oss's) is chunked on its output; the chunked module then returns
(output, None), the scores being what its decoder layer discards. A per-token keyword input its layer hands
it beside the hidden states (DeepSeek-V4's hash-routed MoE takes `input_ids` (B, T), which pick each token's
experts) is cut to the chunk's columns with them; one that requires grad, or any other tensor, is refused.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.engine.chunks import (
    backward_into,
    check_accumulates,
    chunk_bounds,
    grad_or_zeros,
    leaf,
    trainable_parameters,
)


class ChunkedMLP(torch.autograd.Function):
    """autograd.Function: x (B, T, d) -> mlp(x), computed and differentiated `chunk` tokens at a time."""

    @staticmethod
    def forward(ctx, x, mlp: nn.Module, forward_fn, chunk: int, keep: int | None, per_token: dict, *params):
        ctx.mlp_fn, ctx.chunk, ctx.keep, ctx.params = forward_fn, chunk, keep, params
        ctx.per_token = per_token
        ctx.save_for_backward(x)
        out = torch.empty_like(x)
        for start, end in chunk_bounds(x.shape[1], chunk, keep):
            out[:, start:end] = forward_fn(x[:, start:end].contiguous(), **_columns(per_token, start, end))
        return out

    @staticmethod
    def backward(ctx, grad_out):
        check_accumulates(ctx, "mst's chunked MLP")
        (x,) = ctx.saved_tensors
        grad_x = torch.empty_like(x)
        for start, end in chunk_bounds(x.shape[1], ctx.chunk, ctx.keep):
            piece = leaf(x[:, start:end].contiguous())
            with torch.enable_grad():
                out = ctx.mlp_fn(piece, **_columns(ctx.per_token, start, end))
            backward_into([out], [grad_out[:, start:end]], [piece], ctx.params)
            grad_x[:, start:end] = grad_or_zeros(piece)
        return (grad_x, None, None, None, None, None, *([None] * len(ctx.params)))


def _columns(per_token: dict, start: int, end: int) -> dict:
    """Each per-token keyword input (B, T, ...) cut to columns start..end; None passes as it is."""
    return {name: None if value is None else value[:, start:end] for name, value in per_token.items()}


def _per_token(x: Tensor, kwargs: dict) -> dict:
    """The MLP's keyword inputs, each None or a (B, T, ...) tensor like `x` that carries no gradient;
    ConfigError for any other (module docstring)."""
    for name, value in kwargs.items():
        if value is None:
            continue
        cut = isinstance(value, Tensor) and tuple(value.shape[:2]) == tuple(x.shape[:2])
        if not cut or value.requires_grad:
            raise ConfigError(f"mst: the MLP's argument {name!r} is not a per-token input without gradient "
                              f"(shape {tuple(getattr(value, 'shape', ()))} beside hidden states of shape "
                              f"{tuple(x.shape)}), which its chunks cannot cut")
    return kwargs


def chunk_mlp(mlp: nn.Module, chunk: int, keep_chunks: int | None = None, pair: bool = False) -> None:
    """Make `mlp` run in chunks (instance-level override of `forward`); undo with `unchunk_mlp`.
    `keep_chunks`: simulation only (see `StreamConfig.keep_chunks`). `pair`: the MLP returns (hidden states,
    router logits) (Llama 4's mixture of experts, its hidden states flattened to (B * c, d)); chunked, it
    returns (hidden states (B, T, d), None), as its layer unpacks the pair and uses only the hidden states."""
    original = mlp.forward
    hidden = (lambda x, **kwargs: original(x, **kwargs)[0].view(x.shape)) if pair else original

    def forward(self, x: Tensor, **kwargs):
        if not torch.is_grad_enabled():
            return original(x, **kwargs)
        out = ChunkedMLP.apply(x, self, hidden, chunk, keep_chunks, _per_token(x, kwargs),
                               *trainable_parameters([self]))
        return (out, None) if pair else out

    mlp.forward = types.MethodType(forward, mlp)


def unchunk_mlp(mlp: nn.Module) -> None:
    """Restore the class's own `forward` on `mlp`."""
    if "forward" in vars(mlp):
        del mlp.forward
