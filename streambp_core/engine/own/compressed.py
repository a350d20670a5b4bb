"""DeepSeek-V4's decoder layer (sliding-window attention over its own keys, plus compressed keys and values),
streamed: each chunk is recomputed against the prefix's keys as an attention layer's is
(`engine.own.layer`), with the compressor's state before it carried as a recurrent layer's is
(`engine.own.recurrent`).

transformers' V4 attention (`DeepseekV4Attention`) appends to its sliding-window keys K (B, 1, T, D) (K is
V) the compressed entries C (B, n, D) of its compressor: one per window of r source tokens (r = 4 in a
compressed sparse attention layer, CSA; 128, or the config's, in a heavily compressed one, HCA), a
softmax-gated sum of the window's projected keys, normed and rotated, which carries gradients to the layer's
input and the compressor's weights. A CSA entry also takes the first half (Ca) of the window before it. Query
t sees entry w once its window is complete ((t + 1) // r > w), in a CSA layer only the entries its indexer
picks (top-k, no grad). Fed one call at a time, the compressor reads and writes its state through
transformers' per-layer cache (`cache.layers[layer_idx]`: `store_compression_weights`,
`update_overlap_state`, `update_compressor_states`), which `CompressorCarry` answers, duck-typed, for one
chunk: the projected keys and gates of the tokens since the last complete window (the buffer, fewer than r),
the previous window's Ca keys and gates (the overlap), the entries before the chunk. A window that straddles
a chunk boundary is closed by the chunk holding its last token, from the buffer the chunks before left.

Per layer (`OwnLayer` holds the layer's input alone between the passes), backward:
1. chunks first to last without grad, each stopped once its compressor has written its entries: K (each
   position's computed once), C, and the state (buffer, overlap, entry count) before each chunk; in a CSA
   layer, the indexer's pick (B, T, k) for the whole sequence from one forward stopped at the indexer (as
   the whole forward picked: a chunk's own scores could tie differently);
2. chunks last to first: the chunk's forward under autograd on its input, its boundary's buffer and
   overlap, K[..., :start, :] and the entries before it (leaves), its indexer returning rows start..end of
   the pick; back-propagate at once its output gradient, dK[..., start:end, :] and dC of the entries it
   closes (what later chunks' queries left on them) and the gradients of its final buffer and overlap
   (carried from the chunk after it); the prefix leaves' gradients add to dK and dC, the buffer's and
   overlap's are carried to the chunk before, the input's written into its slice.
Chunks are `recurrent.recurrent_bounds`'.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass, field

import torch
from torch import Tensor, nn

from streambp_core.engine.chunks import backward_into, grad_or_zeros, leaf
from streambp_core.engine.own.arguments import LayerCall, layer_outputs
from streambp_core.engine.own.cache import KeysCaptured, PrefixCache
from streambp_core.engine.own.recurrent import recurrent_bounds
from streambp_core.measure.tags import KV, memory_category

COMPRESSED = "attention and compressed keys"
"""How a DeepSeek-V4 layer with a compressor mixes tokens (`engine.own.layer`'s kinds)."""
MAIN = "compressor"
"""The name under which the compressor keeps its state in transformers' cache (its indexer's is `indexer`)."""


def compressor_of(layer: nn.Module) -> nn.Module | None:
    """A decoder layer's attention compressor (DeepSeek-V4's CSA and HCA layers), or None."""
    return getattr(getattr(layer, "self_attn", None), "compressor", None)


@dataclass
class Carried:
    """The compressor's state between two chunks (module docstring): its buffer's projected keys and gates
    (B, < r, ...), its overlap's (B, r, D) (CSA, once a window closed), None where there is none yet, and
    the count of entries written."""

    buffer_kv: Tensor | None = None
    buffer_gate: Tensor | None = None
    overlap_kv: Tensor | None = None
    overlap_gate: Tensor | None = None
    count: int = 0

    def tensors(self) -> list[Tensor]:
        """Its tensors, in field order, those that exist."""
        state = (self.buffer_kv, self.buffer_gate, self.overlap_kv, self.overlap_gate)
        return [t for t in state if t is not None]

    def leaves(self) -> Carried:
        """The same state, each tensor a leaf of a fresh graph."""
        return Carried(*(None if t is None else leaf(t) for t in (self.buffer_kv, self.buffer_gate,
                                                                  self.overlap_kv, self.overlap_gate)),
                       count=self.count)


@dataclass
class CompressorCarry:
    """One layer's compressor state for one call, as transformers' `DeepseekV4CSACache` (and HCA's) keeps it
    (module docstring): from `before` and the `entries` before the call (B, count, D) or None; the entries the
    call writes go to `written`, its state after to `after`. With `stop`, the call ends (`KeysCaptured`) once
    the compressor wrote its entries. The indexer's state starts empty each call (a chunk's indexer does not
    run, `picked`)."""

    compress_rate: int
    layer_idx: int
    before: Carried = field(default_factory=Carried)
    entries: Tensor | None = None
    stop: bool = False
    after: Carried | None = None
    written: Tensor | None = None
    _other: dict = field(default_factory=dict)

    def _state(self, name: str) -> Carried:
        if name == MAIN:
            if self.after is None:
                self.after = Carried(**vars(self.before))
            return self.after
        return self._other.setdefault(name, Carried())

    def store_compression_weights(self, name: str, kv: Tensor, gate: Tensor) -> tuple[Tensor, Tensor, int]:
        """[buffer, kv] and [buffer, gate] cut to whole windows, and the first window's position; keeps the
        rest as the buffer (transformers' `DeepseekV4HCACache.store_compression_weights`)."""
        state = self._state(name)
        first_window_position = state.count * self.compress_rate
        if state.buffer_kv is not None and state.buffer_kv.shape[1]:
            kv, gate = torch.cat([state.buffer_kv, kv], dim=1), torch.cat([state.buffer_gate, gate], dim=1)
        usable = (kv.shape[1] // self.compress_rate) * self.compress_rate
        state.buffer_kv, state.buffer_gate = kv[:, usable:], gate[:, usable:]
        return kv[:, :usable], gate[:, :usable], first_window_position

    def update_overlap_state(self, name: str, chunk_kv: Tensor, chunk_gate: Tensor, head_dim: int):
        """The overlap before this call; keeps the Ca half of its last window (`DeepseekV4CSACache`)."""
        state = self._state(name)
        prior = state.overlap_kv, state.overlap_gate
        state.overlap_kv, state.overlap_gate = chunk_kv[:, -1, :, :head_dim], chunk_gate[:, -1, :, :head_dim]
        return prior

    def update_compressor_states(self, name: str, compressed: Tensor) -> Tensor:
        """The entries before this call, then its own `compressed` (B, n, D); the indexer's own alone."""
        state = self._state(name)
        state.count += compressed.shape[1]
        if name != MAIN:
            return compressed  # the indexer runs on the whole sequence alone, its first and only call
        self.written = compressed
        if self.stop:
            raise KeysCaptured
        return compressed if self.entries is None else torch.cat([self.entries, compressed], dim=1)


def compressor_carry(layer: nn.Module) -> CompressorCarry | None:
    """An empty carry for `layer`'s compressor (the whole sequence's first call), or None without one."""
    compressor = compressor_of(layer)
    if compressor is None:
        return None
    return CompressorCarry(compressor.compress_rate, layer.self_attn.layer_idx)


@contextmanager
def picked(layer: nn.Module, pick: Tensor | None, start: int, end: int):
    """Inside: `layer`'s compressor's indexer returns rows start..end of the whole sequence's `pick`
    (B, T, k), -1 where a query has no entry to pick (module docstring); its own forward is given back on
    leaving."""
    indexer = getattr(compressor_of(layer), "indexer", None)
    if indexer is None or pick is None:
        yield
        return
    rows = pick[:, start:end]
    indexer.forward = lambda *args, **kwargs: rows
    try:
        yield
    finally:
        del indexer.forward


def _cache(carry: CompressorCarry, prefix: Tensor) -> PrefixCache:
    """A chunk's cache: the prefix's keys (K is V), and `carry` for its compressor."""
    cache = PrefixCache(prefix, prefix)
    cache.compressor = carry
    return cache


def _whole_pick(call: LayerCall, hidden: Tensor) -> Tensor | None:
    """The indexer's pick (B, T, k) on the whole sequence, from one no-grad forward stopped there; None for
    a layer without an indexer."""
    indexer = getattr(compressor_of(call.layer), "indexer", None)
    if indexer is None:
        return None
    pick = []

    def record(module, args, output):
        pick.append(output)
        raise KeysCaptured

    handle = indexer.register_forward_hook(record)
    empty = hidden.new_empty(0, 0, 0, 0)
    try:
        with torch.no_grad():
            call.run(hidden, _cache(compressor_carry(call.layer), empty))
    except KeysCaptured:
        return pick[0]
    finally:
        handle.remove()
    raise RuntimeError(f"{type(call.layer).__name__}'s indexer did not run in backward")


def _forward_pass(call: LayerCall, hidden: Tensor, bounds, implementation: str
                  ) -> tuple[Tensor, Tensor, list[Carried]]:
    """K (B, 1, T, D), C (B, n, D) and the state before each chunk (module docstring, step 1)."""
    rate = compressor_of(call.layer).compress_rate
    state, boundaries, keys, entries = Carried(), [], [], []
    empty = hidden.new_empty(0, 0, 0, 0)
    with torch.no_grad(), memory_category(KV):
        for start, end in bounds:
            boundaries.append(state)
            carry = CompressorCarry(rate, call.layer.self_attn.layer_idx, state, stop=True)
            cache = _cache(carry, empty)
            try:
                call.run(hidden[:, start:end], cache, call.chunk(start, end, implementation, hidden.device))
            except KeysCaptured:
                pass
            if carry.written is None:
                raise RuntimeError(f"{type(call.layer).__name__}'s compressor wrote no entries in backward")
            keys.append(cache.chunk_keys)
            entries.append(carry.written)
            state = carry.after
    return torch.cat(keys, dim=-2), torch.cat(entries, dim=1), boundaries


def compressed_backward(call: LayerCall, partition_size: int, implementation: str, hidden: Tensor,
                        grad_out: Tensor, params) -> Tensor:
    """dL/d(the layer's input) (B, T, ...) of a DeepSeek-V4 layer with a compressor; the parameters'
    gradients land in `.grad` (module docstring, step 2)."""
    bounds = recurrent_bounds(call.length, partition_size)
    keys, entries, boundaries = _forward_pass(call, hidden, bounds, implementation)
    pick = _whole_pick(call, hidden)
    rate = compressor_of(call.layer).compress_rate
    with memory_category(KV):
        grad_keys, grad_entries = torch.zeros_like(keys), torch.zeros_like(entries)
    grad_in = torch.empty_like(hidden)
    carried: list[Tensor] = []  # the gradients of the final buffer and overlap of the chunk being taken
    for (start, end), boundary in zip(reversed(bounds), reversed(boundaries), strict=True):
        h, before = leaf(hidden[:, start:end]), boundary.leaves()
        prefix, earlier = leaf(keys[..., :start, :]), leaf(entries[:, :boundary.count])
        carry = CompressorCarry(rate, call.layer.self_attn.layer_idx, before,
                                earlier if boundary.count else None)
        cache = _cache(carry, prefix)
        with torch.enable_grad(), picked(call.layer, pick, start, end):
            output = layer_outputs(call.run(h, cache, call.chunk(start, end, implementation,
                                                                 hidden.device)))[0]
        written = carry.after.tensors() if carried else []
        closed = slice(boundary.count, carry.after.count)
        backward_into([output, cache.chunk_keys, carry.written, *written],
                      [grad_out[:, start:end], grad_keys[..., start:end, :], grad_entries[:, closed],
                       *carried],
                      [h, *before.tensors(), prefix, earlier], params)
        grad_in[:, start:end] = grad_or_zeros(h)
        if prefix.grad is not None:
            grad_keys[..., :start, :] += prefix.grad
        if earlier.grad is not None:
            grad_entries[:, :boundary.count] += earlier.grad
        carried = [grad_or_zeros(t) for t in before.tensors()]
    return grad_in
