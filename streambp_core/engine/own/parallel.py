"""The model's own decoder layer that mixes tokens through attention and a recurrent mixer side by side
(Falcon-H1: a Mamba2 mixer and attention on the same normed input, their outputs summed), streamed: each
chunk is recomputed against the prefix's keys and values as an attention layer's is (`engine.own.layer`),
from the state and conv halo before it as a recurrent layer's is (`engine.own.recurrent`).

Per layer (`OwnLayer` holds the layer's input alone between the passes), backward:
1. chunks first to last without grad, each against the keys and values the chunks before it wrote and from
   the state and halo the chunk before left: the whole sequence's keys and values K, V (B, H, T, D), each
   position's computed once, and the (state, halo) before each chunk;
2. chunks last to first: the chunk's forward under autograd on its input, its boundary's state and halo and
   the prefix K, V[..., :start, :] (leaves); back-propagate at once its output gradient,
   dK, dV[..., start:end, :] (what later chunks' queries left on its own keys and values) and the gradients
   of its final state and halo (carried from the chunk after it); the prefix leaves' gradients add to
   dK, dV[..., :start, :], the state's and halo's are carried to the chunk before, the input's written into
   its slice.
Chunks are `recurrent.recurrent_bounds`' (a trailing one-token chunk joins the one before). The chunk's
arguments are `LayerCall.chunk`'s: the attention's mask cut to rows start..end and keys 0..end, the
recurrent mixer's (B, T) padding mask cut to the chunk's columns as a per-token input.
"""

from __future__ import annotations

import torch
from torch import Tensor

from streambp_core.engine.chunks import backward_into, grad_or_zeros, leaf
from streambp_core.engine.own.arguments import LayerCall, layer_outputs
from streambp_core.engine.own.recurrent import StateCache, recurrent_bounds
from streambp_core.measure.tags import KV, memory_category


def _forward_pass(call: LayerCall, hidden: Tensor, bounds, implementation: str
                  ) -> tuple[Tensor, Tensor, list[tuple]]:
    """K, V (B, H, T, D) of the whole sequence and the (state, halo) before each chunk (module docstring,
    step 1)."""
    boundaries, keys, values = [(None, None)], None, None
    with torch.no_grad(), memory_category(KV):
        for start, end in bounds:
            prefix = (hidden.new_empty(0, 0),) * 2 if keys is None else (keys[..., :start, :],
                                                                          values[..., :start, :])
            cache = StateCache(*boundaries[-1], prefix=prefix)
            call.run(hidden[:, start:end], cache, call.chunk(start, end, implementation, hidden.device))
            if keys is None:
                keys, values = (t.new_empty(*t.shape[:-2], call.length, t.shape[-1])
                                for t in (cache.chunk_keys, cache.chunk_values))
            keys[..., start:end, :], values[..., start:end, :] = cache.chunk_keys, cache.chunk_values
            boundaries.append((cache.final_state, cache.final_halo))
    return keys, values, boundaries[:-1]


def parallel_backward(call: LayerCall, partition_size: int, implementation: str, hidden: Tensor,
                      grad_out: Tensor, params) -> Tensor:
    """dL/d(the layer's input) (B, T, d) of a layer mixing through attention and a recurrent state side by
    side; the parameters' gradients land in `.grad` (module docstring, step 2)."""
    bounds = recurrent_bounds(call.length, partition_size)
    keys, values, boundaries = _forward_pass(call, hidden, bounds, implementation)
    with memory_category(KV):
        grad_kv = [torch.zeros_like(keys), torch.zeros_like(values)]
    grad_in = torch.empty_like(hidden)
    carried: list[Tensor] = []  # the gradients of the final state and halo of the chunk being taken
    for (start, end), boundary in zip(reversed(bounds), reversed(boundaries), strict=True):
        h = leaf(hidden[:, start:end])
        before = [None if t is None else leaf(t) for t in boundary]
        prefix = [leaf(t[..., :start, :]) for t in (keys, values)]
        cache = StateCache(*before, prefix=(prefix[0], prefix[1]))
        with torch.enable_grad():
            output = layer_outputs(call.run(h, cache, call.chunk(start, end, implementation,
                                                                 hidden.device)))[0]
        written = [t for t in (cache.final_state, cache.final_halo) if t is not None] if carried else []
        taken = [t for t in before if t is not None]
        backward_into([output, cache.chunk_keys, cache.chunk_values, *written],
                      [grad_out[:, start:end], *(g[..., start:end, :] for g in grad_kv), *carried],
                      [h, *taken, *prefix], params)
        grad_in[:, start:end] = grad_or_zeros(h)
        for grad, tensor in zip(grad_kv, prefix, strict=True):
            if tensor.grad is not None:
                grad[..., :start, :] += tensor.grad
        carried = [grad_or_zeros(t) for t in taken]
    return grad_in
