"""The model's own decoder layer, streamed: forward on the whole sequence keeping only the layer's input,
backward chunk by chunk, last chunk first, against the prefix's keys and values.

transformers' decoder layers (`GradientCheckpointingLayer`) hand each call to their
`_gradient_checkpointing_func` while checkpointing is on; `streamed_layers` installs `StreamedCall` there for
the length of one forward, so the model's own forward computes the stack's prelude (embeddings, rotary
tables, the mask of each layer type) and each layer runs as `OwnLayer`.

`OwnLayer`, per layer:
Forward (no grad): the layer's forward on the whole sequence with an empty `PrefixCache` (so the layer is
checked to write its keys and values through the cache); only the input (B, T, d) is kept.
Backward:
1. the whole sequence's keys and values K, V (B, H, T, D) from one no-grad forward that stops at the cache
   (`CaptureCache`), once per layer; their gradients dK, dV start at zero;
2. for each chunk start..end, last first: the layer's forward on the chunk's input (a leaf) with a
   `PrefixCache` whose prefix is K, V[..., :start, :] as leaves, the chunk's cut arguments
   (`arguments.LayerCall.chunk`); backward from the chunk's output gradient, plus dK, dV[..., start:end, :]
   (what later chunks' queries left on these positions) on the chunk's own keys and values;
3. the chunk's input gradient is written into its slice; the prefix leaves' gradients add to
   dK, dV[..., :start, :]; the parameters' gradients accumulate in `.grad`.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from functools import partial

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
from streambp_core.engine.own.arguments import LayerCall
from streambp_core.engine.own.cache import CaptureCache, KeysCaptured, PrefixCache
from streambp_core.measure.tags import KV, memory_category


@dataclass(frozen=True)
class OwnPlan:
    """How the own-layer stream cuts the sequence."""

    partition_size: int
    """Query tokens per chunk in backward."""
    attn_implementation: str = "sdpa"
    """The model's attention implementation (transformers' `_attn_implementation`), which a chunk's mask
    takes the form of."""
    keep_chunks: int | None = None
    """Simulation only: run the first and last `keep_chunks` chunks of each loop (`StreamConfig`)."""


@dataclass(frozen=True)
class StreamedCall:
    """What a decoder layer calls in place of its checkpoint function: the call as `OwnLayer`."""

    plan: OwnPlan

    def __call__(self, function: partial, *args):
        hidden = args[0]
        call = LayerCall.of(function, args, hidden.shape[1])
        return OwnLayer.apply(hidden, call, self.plan, *trainable_parameters([call.layer]))


class OwnLayer(torch.autograd.Function):
    """autograd.Function: a decoder layer's input (B, T, d) -> its output, streamed in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, call: LayerCall, plan: OwnPlan, *params):
        ctx.call, ctx.plan, ctx.params = call, plan, params
        first = min(plan.partition_size, call.length)
        call.chunk(0, first, plan.attn_implementation, hidden.device)  # refuses what cannot be cut
        cache = PrefixCache(hidden.new_empty(0, 0), hidden.new_empty(0, 0))
        output = _checked_run(call, hidden, cache)
        ctx.save_for_backward(hidden)
        return output

    @staticmethod
    def backward(ctx, grad_out):
        check_accumulates(ctx, "streambp's own-layer stream")
        (hidden,) = ctx.saved_tensors
        grad_in = stream_backward(ctx.call, ctx.plan, hidden, grad_out, ctx.params)
        return (grad_in, None, None, *([None] * len(ctx.params)))


def _checked_run(call: LayerCall, hidden: Tensor, cache: PrefixCache) -> Tensor:
    """The layer's output on the whole sequence; ConfigError when it cannot be streamed (module docstring)."""
    family = type(call.layer).__name__
    try:
        output = call.run(hidden, cache)
    except AttributeError as error:
        raise ConfigError(f"streambp: {family}'s attention reads the cache's {error.name or 'attributes'} "
                          "beyond transformers' update(), which the generic stream's cache does not "
                          "have") from None
    if not isinstance(output, Tensor):
        raise ConfigError(f"streambp: {family}.forward returns a {type(output).__name__}, not the hidden "
                          "states alone")
    keys = cache.chunk_keys
    if keys is None:
        raise ConfigError(f"streambp: {family} does not write its keys and values through the cache, from "
                          "which the generic stream takes the prefix's")
    if keys.shape[-2] != call.length or cache.chunk_values.shape[-2] != call.length:
        raise ConfigError(f"streambp: {family} writes keys of shape {tuple(keys.shape)} to its cache, with "
                          "no "
                          f"sequence axis -2 of {call.length}")
    return output


def whole_keys(call: LayerCall, hidden: Tensor) -> tuple[Tensor, Tensor]:
    """The layer's keys and values (B, H, T, D) for the whole sequence, from one forward stopped at its
    cache."""
    cache = CaptureCache()
    with torch.no_grad(), memory_category(KV):
        try:
            call.run(hidden, cache)
        except KeysCaptured:
            return cache.keys, cache.values
    raise RuntimeError(f"{type(call.layer).__name__} wrote no keys to its cache in backward")


def stream_backward(call: LayerCall, plan: OwnPlan, hidden: Tensor, grad_out: Tensor, params) -> Tensor:
    """The layer input's gradient (B, T, d); the parameters' gradients land in `.grad` (module docstring)."""
    keys, values = whole_keys(call, hidden)
    with memory_category(KV):
        grad_keys, grad_values = torch.zeros_like(keys), torch.zeros_like(values)
    grad_in = torch.empty_like(hidden)
    for start, end in reversed(chunk_bounds(call.length, plan.partition_size, plan.keep_chunks)):
        h = leaf(hidden[:, start:end])
        cache = PrefixCache(leaf(keys[..., :start, :]), leaf(values[..., :start, :]))
        with torch.enable_grad():
            output = call.run(h, cache, call.chunk(start, end, plan.attn_implementation, hidden.device))
        backward_into([output, cache.chunk_keys, cache.chunk_values],
                      [grad_out[:, start:end], grad_keys[..., start:end, :], grad_values[..., start:end, :]],
                      [h, cache.prefix_keys, cache.prefix_values], params)
        grad_in[:, start:end] = grad_or_zeros(h)
        if start and cache.prefix_keys.grad is not None:
            grad_keys[..., :start, :] += cache.prefix_keys.grad
        if start and cache.prefix_values.grad is not None:
            grad_values[..., :start, :] += cache.prefix_values.grad
    return grad_in


@contextmanager
def streamed_layers(layers: nn.ModuleList, plan: OwnPlan):
    """Inside: each of `layers` runs as `OwnLayer` when called with grad enabled (module docstring); every
    attribute it changes on a layer is put back on leaving. Each layer must be a transformers
    `GradientCheckpointingLayer` (whose checkpoint entry it takes)."""
    names = ("gradient_checkpointing", "_gradient_checkpointing_func", "training")
    before = [(layer, {name: vars(layer)[name] for name in names if name in vars(layer)}) for layer in layers]
    call = StreamedCall(plan)
    try:
        for layer in layers:
            layer.gradient_checkpointing, layer.training = True, True
            layer._gradient_checkpointing_func = call
        yield
    finally:
        for layer, kept in before:
            for name in names:
                if name in kept:
                    setattr(layer, name, kept[name])
                elif name in vars(layer):
                    delattr(layer, name)
