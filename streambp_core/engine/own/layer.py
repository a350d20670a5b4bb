"""The model's own decoder layer, streamed: forward on the whole sequence keeping only the layer's input,
backward chunk by chunk, last chunk first, against the prefix's keys and values.

transformers' decoder layers (`GradientCheckpointingLayer`) hand each call to their
`_gradient_checkpointing_func` while checkpointing is on; `streamed_layers` installs `StreamedCall` there for
the length of one forward, so the model's own forward computes the stack's prelude (embeddings, rotary
tables, the mask of each layer type) and each layer runs as `OwnLayer`.

`OwnLayer`, per layer:
Forward (no grad): the layer's forward on the whole sequence with an empty `PrefixCache` (so the layer is
checked to write its keys and values through the cache); only the input (B, T, d) is kept, with its
per-token inputs that require grad (`arguments.LayerCall.graded`: Gemma 4's `per_layer_input`), which the
function takes as inputs too.
Backward:
1. the whole sequence's keys and values K, V (B, H, T, D) from one no-grad forward that stops at the cache
   (`CaptureCache`), once per layer; their gradients dK, dV start at zero;
2. for each chunk start..end, last first: the layer's forward on the chunk's input and per-token inputs
   (leaves) with a `PrefixCache` whose prefix is K, V[..., :start, :] as leaves, the chunk's cut arguments
   (`arguments.LayerCall.chunk`); backward from the chunk's output gradient, plus dK, dV[..., start:end, :]
   (what later chunks' queries left on these positions) on the chunk's own keys and values;
3. the chunk's input and per-token input gradients are written into their slices; the prefix leaves'
   gradients add to dK, dV[..., :start, :]; the parameters' gradients accumulate in `.grad`.
A layer with a sparse-attention indexer (DSA: DeepSeek-V3.2, GLM-5) picks each query's top-k keys under no
grad: step 1 goes on to the indexer and records its pick for the whole sequence (B, T, k), and each chunk's
indexer returns rows start..end of it (`arguments.key_indices_rows`) instead of scoring again: the indexer
scores in float32 (and ties at ReLU's zero), so a chunk's own pick can differ from the whole forward's; its
weights get no gradient, as in plain. Qwen4-Exp's QSA indexer selects keys as a boolean mask (B, 1, T, T)
and runs before the cache's update: step 1 records its mask first and stops at the keys, and each chunk's
indexer returns rows start..end against keys 0..end (`pick_rows`). A layer that returns more than its
hidden states (GLM-5's returns its top-k key indices (B, T, k), which the next layer may reuse; Bamba's its
attention weights, None under SDPA) returns the rest from the whole sequence's forward, with no gradient.
A layer that mixes through attention and a recurrent state side by side (Falcon-H1) streams through
`parallel`; one that mixes through a recurrent state alone, or not at all, through `recurrent`; one whose
attention appends compressed keys and values built through its cache's state (DeepSeek-V4's CSA and HCA
layers) through `compressed`. A layer returning a tuple (Falcon-H1's `(hidden,)`) gets a tuple back, as
the model indexes it.
Keys and values shared across layers (`sharing`): a store also returns its K, V, and starts its dK, dV from
their gradient; a consumer takes its store's K, V as inputs instead of computing its own, its chunk attends to
K, V[..., :end, :] as leaves, and it returns their gradient.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field
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
from streambp_core.engine.own.arguments import LayerCall, key_indices_rows, layer_outputs
from streambp_core.engine.own.cache import CaptureCache, KeysCaptured, PrefixCache
from streambp_core.engine.own.compressed import COMPRESSED, compressed_backward, compressor_carry
from streambp_core.engine.own.parallel import parallel_backward
from streambp_core.engine.own.recurrent import ATTENTION, PARALLEL, StateCache, mixing, state_backward
from streambp_core.engine.own.sharing import SHARED_NAME, KVSharing
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
class Inputs:
    """What a layer's function takes beyond the hidden states: its per-token inputs that require grad (by
    name, `LayerCall.graded`), then, for a consumer of shared keys and values, their store's K, V
    (`sharing`)."""

    graded: tuple[str, ...]
    sharing: KVSharing
    returns_tuple: list[bool] = field(default_factory=list)
    """Filled by the function's forward: whether the layer returns a tuple (Falcon-H1's `(hidden,)`), which
    the model indexes, or the hidden states alone."""

    @property
    def count(self) -> int:
        """How many tensors the function takes beyond the hidden states, before the parameters."""
        return len(self.graded) + (2 if self.sharing.role == "reuse" else 0)


@dataclass(frozen=True)
class StreamedCall:
    """What a decoder layer calls in place of its checkpoint function: the call as `OwnLayer`."""

    plan: OwnPlan

    def __call__(self, function: partial, *args):
        call = LayerCall.of(function, args)
        inputs = Inputs(call.graded, KVSharing.of(call.layer))
        extra = [*(call.arguments[name] for name in inputs.graded), *inputs.sharing.taken(call.arguments)]
        params = trainable_parameters([call.layer])
        outputs = OwnLayer.apply(args[0], call, self.plan, inputs, *extra, *params)
        outputs = outputs if isinstance(outputs, tuple) else (outputs,)
        shared = inputs.sharing.outputs
        if shared:
            inputs.sharing.hand_over(call.arguments, *outputs[1:1 + shared])
        output = (outputs[0], *outputs[1 + shared:])
        return output if inputs.returns_tuple[0] else output[0]


class OwnLayer(torch.autograd.Function):
    """autograd.Function: a decoder layer's input (B, T, d), its per-token inputs that require grad and a
    consumer's shared K, V -> its output (and a store's K, V), streamed in backward."""

    @staticmethod
    def forward(ctx, hidden: Tensor, call: LayerCall, plan: OwnPlan, inputs: Inputs, *tensors):
        extra, params = tensors[:inputs.count], tensors[inputs.count:]
        ctx.call, ctx.plan, ctx.inputs, ctx.params = call, plan, inputs, params
        first = min(plan.partition_size, call.length)
        call.chunk(0, first, plan.attn_implementation, hidden.device)  # refuses what cannot be cut
        cache = StateCache(prefix=(hidden.new_empty(0, 0), hidden.new_empty(0, 0)))
        cache.compressor = compressor_carry(call.layer)
        arguments = call.arguments | inputs.sharing.handed(*extra[len(inputs.graded):])
        outputs, ctx.kind = _checked_run(call, hidden, cache, arguments, inputs.returns_tuple)
        output, *rest = outputs
        if ctx.kind != ATTENTION and inputs.count:
            raise ConfigError(f"streambp: {type(call.layer).__name__} takes per-token inputs that require "
                              f"grad in a {ctx.kind} layer, which the own-layer stream does not carry")
        ctx.save_for_backward(hidden, *extra)
        ctx.mark_non_differentiable(*(t for t in rest if t is not None))
        shared = arguments[SHARED_NAME][inputs.sharing.key] if inputs.sharing.role == "store" else ()
        return (output, *shared, *rest) if shared or rest else output

    @staticmethod
    def backward(ctx, grad_out, *grad_outputs):
        grad_shared = grad_outputs[:ctx.inputs.sharing.outputs]
        check_accumulates(ctx, "streambp's own-layer stream")
        hidden, *extra = ctx.saved_tensors
        plan = ctx.plan
        if ctx.kind == COMPRESSED:
            grad_in = compressed_backward(ctx.call, plan.partition_size, plan.attn_implementation, hidden,
                                          grad_out, ctx.params)
            return (grad_in, None, None, None, *([None] * len(ctx.params)))
        if ctx.kind == PARALLEL:
            grad_in = parallel_backward(ctx.call, plan.partition_size, plan.attn_implementation, hidden,
                                        grad_out, ctx.params)
            return (grad_in, None, None, None, *([None] * len(ctx.params)))
        if ctx.kind != ATTENTION:
            grad_in = state_backward(ctx.call, ctx.kind, plan.partition_size, plan.attn_implementation,
                                     hidden, grad_out, ctx.params)
            return (grad_in, None, None, None, *([None] * len(ctx.params)))
        grads = stream_backward(ctx.call, ctx.plan, ctx.inputs, [hidden, *extra], grad_out, grad_shared,
                                ctx.params)
        return (grads[0], None, None, None, *grads[1:], *([None] * len(ctx.params)))


def _checked_run(call: LayerCall, hidden: Tensor, cache: StateCache, arguments: dict,
                 returns_tuple: list[bool]) -> tuple[tuple[Tensor, ...], str]:
    """The layer's outputs on the whole sequence (the hidden states, then any tensors it returns beside them
    that need no gradient) and how it mixes tokens (`recurrent.mixing`); ConfigError when it cannot be
    streamed (module docstring)."""
    family = type(call.layer).__name__
    try:
        returned = call.run(hidden, cache, arguments)
        outputs = layer_outputs(returned)
        returns_tuple.append(isinstance(returned, tuple))
    except AttributeError as error:
        raise ConfigError(f"streambp: {family}'s attention reads the cache's {error.name or 'attributes'} "
                          "beyond transformers' update() and update_indexer(), which the generic stream's "
                          "cache does not have") from None
    if outputs is None or any(t is not None and t.requires_grad for t in outputs[1:]):
        raise ConfigError(f"streambp: {family}.forward returns more than the hidden states and tensors "
                          "that carry no gradient (or None)")
    if KVSharing.of(call.layer).role == "reuse":
        return outputs, ATTENTION  # a consumer attends to its store's keys and values (`sharing`)
    kind = COMPRESSED if cache.compressor is not None else mixing(call, cache)
    keys = cache.chunk_keys
    if kind not in (ATTENTION, PARALLEL, COMPRESSED):
        return outputs, kind
    if keys.shape[-2] != call.length or cache.chunk_values.shape[-2] != call.length:
        raise ConfigError(f"streambp: {family} writes keys of shape {tuple(keys.shape)} to its cache, with "
                          "no "
                          f"sequence axis -2 of {call.length}")
    return outputs, kind


def _indexer(layer: nn.Module) -> nn.Module | None:
    return getattr(getattr(layer, "self_attn", None), "indexer", None)


def indexed(layer: nn.Module) -> bool:
    """Whether `layer`'s attention runs a sparse-attention indexer that picks each query's keys."""
    return _indexer(layer) is not None


@contextmanager
def _picked(layer: nn.Module, pick: Tensor | None, start: int, end: int):
    """Inside: `layer`'s indexer returns rows start..end of the whole sequence's `pick` (module docstring);
    its own forward is given back on leaving."""
    indexer = _indexer(layer)
    if indexer is None or pick is None:
        yield
        return
    rows = pick_rows(pick, start, end)
    indexer.forward = lambda *args, **kwargs: rows
    try:
        yield
    finally:
        del indexer.forward


def pick_rows(pick: Tensor, start: int, end: int) -> Tensor:
    """Rows start..end of an indexer's pick: DSA's key positions (B, T, k) (`arguments.key_indices_rows`), or
    QSA's selection mask (B, 1, T, T) cut to keys 0..end."""
    if pick.dtype == torch.bool and pick.dim() == 4:
        return pick[..., start:end, :end]
    return key_indices_rows(pick, start, end)


def whole_keys(call: LayerCall, hidden: Tensor, arguments: dict | None = None,
               ) -> tuple[Tensor, Tensor, Tensor | None]:
    """The layer's keys and values (B, H, T, D) for the whole sequence and its indexer's pick or None, from
    one forward stopped at whichever of its cache's update and its indexer's output comes last (DSA's
    indexer runs after the update, Qwen4-Exp's QSA indexer before)."""
    indexer = _indexer(call.layer)
    cache, pick = CaptureCache(indexer is not None), []

    def record(module, args, output):
        pick.append(output)
        if cache.keys is not None:
            raise KeysCaptured
        cache.indexed = False  # the indexer ran first: stop at the keys

    handle = None if indexer is None else indexer.register_forward_hook(record)
    with torch.no_grad(), memory_category(KV):
        try:
            call.run(hidden, cache, arguments)
        except KeysCaptured:
            return cache.keys, cache.values, (pick or [None])[0]
        finally:
            if handle is not None:
                handle.remove()
    raise RuntimeError(f"{type(call.layer).__name__} wrote no keys to its cache in backward")


def stream_backward(call: LayerCall, plan: OwnPlan, inputs: Inputs, saved: list[Tensor], grad_out: Tensor,
                    grad_shared: tuple, params) -> list[Tensor]:
    """The gradients of the layer's input (B, T, d), of its graded per-token inputs (B, T, ...) and, for a
    consumer, of its store's K, V; the parameters' gradients land in `.grad` (module docstring; `sharing` for
    the K/V hand-over: a consumer's chunk attends to K, V[..., :end, :] as leaves and writes none of its own,
    a store's dK, dV start from its consumers' gradient)."""
    hidden, graded = saved[0], saved[1:1 + len(inputs.graded)]
    reuse = inputs.sharing.role == "reuse"
    keys, values, pick = (*saved[-2:], None) if reuse else whole_keys(
        call, hidden, call.arguments | inputs.sharing.handed())
    with memory_category(KV):
        grad_kv = [torch.zeros_like(t) if g is None else g.clone()
                   for g, t in zip((*grad_shared, None, None)[:2], (keys, values), strict=True)]
    grads = [torch.empty_like(t) for t in (hidden, *graded)]
    for start, end in reversed(chunk_bounds(call.length, plan.partition_size, plan.keep_chunks)):
        leaves = [leaf(t[:, start:end]) for t in (hidden, *graded)]
        prefix = [leaf(t[..., :end if reuse else start, :]) for t in (keys, values)]
        arguments = call.chunk(start, end, plan.attn_implementation, hidden.device)
        arguments |= dict(zip(inputs.graded, leaves[1:], strict=True)) | inputs.sharing.handed(*prefix)
        cache = PrefixCache(*(hidden.new_empty(0, 0),) * 2 if reuse else prefix)
        with torch.enable_grad(), _picked(call.layer, pick, start, end):
            output = layer_outputs(call.run(leaves[0], cache, arguments))[0]
        own = [] if reuse else [cache.chunk_keys, cache.chunk_values]  # a consumer writes no K, V
        own_grads = [g[..., start:end, :] for g in grad_kv][:len(own)]
        backward_into([output, *own], [grad_out[:, start:end], *own_grads], [*leaves, *prefix], params)
        for grad, tensor in zip(grads, leaves, strict=True):
            grad[:, start:end] = grad_or_zeros(tensor)
        for grad, tensor in zip(grad_kv, prefix, strict=True):
            if tensor.grad is not None:
                grad[..., :tensor.shape[-2], :] += tensor.grad
    return [*grads, *grad_kv] if reuse else grads


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
