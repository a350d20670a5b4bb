"""The two Caches a streamed layer hands to the model's own attention (transformers' Cache API, duck-typed:
`update(key_states, value_states, layer_idx, ...)` returns the keys and values attention reads).

`CaptureCache`: records the whole sequence's keys and values in one no-grad forward and stops the layer
right there (`KeysCaptured`), so per layer they are computed once, not once per chunk.
`PrefixCache`: a chunk's keys and values appended to the prefix's, which are leaves of their own graph
(their gradients are collected and pushed back to the positions that made them); it keeps the chunk's own
keys and values so their gradient from later chunks can be fed in.

A sparse-attention indexer (DeepSeek-V3.2's and GLM-5's DSA: a no-grad scorer picking each query's top-k
keys) writes its own keys (B, T, D) through `update_indexer` after the attention's `update`: both caches hand
them back as they are, the whole sequence's; `CaptureCache(indexed=True)` lets the layer's forward go on to
its indexer's pick (`engine.own.layer.whole_keys`), and a chunk's indexer does not run (its pick is the whole
sequence's, `engine.own.layer`).
"""

from __future__ import annotations

import torch
from torch import Tensor


class KeysCaptured(Exception):  # noqa: N818 (a signal, not an error)
    """Raised by `CaptureCache.update` to end the layer's forward once its keys and values are known."""


class CaptureCache:
    """Records the keys and values of one layer's forward, then stops it (`KeysCaptured`); with `indexed`,
    lets it go on to its indexer (whose pick the caller records and stops at)."""

    is_compileable = False

    def __init__(self, indexed: bool = False) -> None:
        self.indexed = indexed
        self.keys: Tensor | None = None
        self.values: Tensor | None = None

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        self.keys, self.values = key_states, value_states
        if not self.indexed:
            raise KeysCaptured
        return key_states, value_states

    def update_indexer(self, indexer_keys: Tensor, layer_idx: int = 0, *args, **kwargs) -> Tensor:
        return indexer_keys

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0


class PrefixCache:
    """The prefix's keys and values (leaves, shape (B, H, s, D)) before a chunk's own."""

    is_compileable = False

    def __init__(self, prefix_keys: Tensor, prefix_values: Tensor) -> None:
        self.prefix_keys, self.prefix_values = prefix_keys, prefix_values
        self.chunk_keys: Tensor | None = None
        self.chunk_values: Tensor | None = None
        self.compressor = None
        """DeepSeek-V4's compressor state for the call (`engine.own.compressed.CompressorCarry`), or None."""

    @property
    def layers(self) -> dict:
        """transformers' per-layer cache states as DeepSeek-V4's compressor reads them
        (`cache.layers[layer_idx]`): the layer's compressor carry."""
        if self.compressor is None:
            raise AttributeError("the cache has no per-layer states", name="layers", obj=self)
        return {self.compressor.layer_idx: self.compressor}

    def update(self, key_states: Tensor, value_states: Tensor, layer_idx: int, *args, **kwargs):
        """cat(prefix, chunk) along the sequence (dim -2) of keys and of values; keeps the chunk's own."""
        if self.chunk_keys is not None:
            raise RuntimeError("a decoder layer wrote its keys and values twice in one forward")
        self.chunk_keys, self.chunk_values = key_states, value_states
        if self.prefix_keys.shape[-2] == 0:
            return key_states, value_states
        return (torch.cat((self.prefix_keys, key_states), dim=-2),
                torch.cat((self.prefix_values, value_states), dim=-2))

    def update_indexer(self, indexer_keys: Tensor, layer_idx: int = 0, *args, **kwargs) -> Tensor:
        """The indexer's keys as written: the whole sequence's (forward); a chunk's indexer does not run."""
        if self.prefix_keys.shape[-2]:
            raise RuntimeError("a chunk's indexer ran against the prefix, whose pick it takes as given")
        return indexer_keys

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.prefix_keys.shape[-2]
