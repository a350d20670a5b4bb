"""Keys and values shared across layers (Gemma 4's E-series, `num_kv_shared_layers`): the last layers (the
consumers) attend to the keys and values (B, H, T, D) that the last earlier layer of their type (the store)
computed, handed over through the model's `shared_kv_states` dict; a consumer has no K/V projection.

Streamed, the hand-over runs through autograd, which orders the backward:
- forward: the store's `OwnLayer` returns its whole-sequence K, V as two more outputs, which
  `KVSharing.hand_over` puts in the model's dict in place of the untracked ones; each consumer's `OwnLayer`
  takes them from there as two more inputs (`KVSharing.taken`) and keeps them for its backward;
- backward: every consumer runs before its store (a later layer, it uses the store's outputs) and returns
  the gradient of K, V over the whole sequence, accumulated chunk by chunk against its keys 0..end;
  autograd sums the consumers' and hands the sum to the store as the gradient of its K, V outputs, from
  which the store's dK, dV start (`engine.own.layer.stream_backward`).
Between the passes the consumers keep their store's K, V alive: O(T * kv_dim) per layer type.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from torch import Tensor, nn

SHARED_NAME = "shared_kv_states"
"""The name of the decoder layer's argument through which the store hands K, V to its consumers."""


@dataclass(frozen=True)
class KVSharing:
    """A layer's part in the K/V hand-over: `role` "store", "reuse" (a consumer) or None, and the `key` of its
    K, V in the model's dict (the layer type)."""

    role: str | None = None
    key: str | None = None

    @classmethod
    def of(cls, layer: nn.Module) -> KVSharing:
        """The part `layer` plays, read from its attention's flags (transformers' Gemma 4 attention)."""
        attention = getattr(layer, "self_attn", None)
        if getattr(attention, "is_kv_shared_layer", False):
            return cls("reuse", attention.layer_type)
        if getattr(attention, "store_full_length_kv", False):
            return cls("store", attention.layer_type)
        return cls()

    @property
    def outputs(self) -> int:
        """How many tensors the layer's function returns beyond the hidden states."""
        return 2 if self.role == "store" else 0

    def taken(self, arguments: dict[str, Any]) -> tuple[Tensor, ...]:
        """A consumer's (K, V) from the model's dict in `arguments`; () for any other layer."""
        if self.role != "reuse":
            return ()
        return tuple(arguments[SHARED_NAME][self.key])

    def hand_over(self, arguments: dict[str, Any], keys: Tensor, values: Tensor) -> None:
        """A store's tracked K, V into the model's dict in `arguments`, for its consumers to take."""
        arguments[SHARED_NAME][self.key] = (keys, values)

    def handed(self, keys: Tensor | None = None, values: Tensor | None = None) -> dict[str, Any]:
        """The `shared_kv_states` argument of one run of the layer: a fresh dict (a store writes there, not in
        the model's), holding `keys`, `values` for a consumer."""
        if self.role is None:
            return {}
        if self.role == "reuse":
            return {SHARED_NAME: {self.key: (keys, values)}}
        return {SHARED_NAME: {}}
