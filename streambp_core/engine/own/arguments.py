"""One call of a decoder layer as the model's own forward made it (`LayerCall`), and the same call cut to a
chunk of query positions start..end against keys 0..end (`LayerCall.chunk`).

What is cut, by argument name (transformers 5's decoder-layer arguments):
- `attention_mask`: a (B or 1, 1, T, T) mask -> rows start..end, columns 0..end; a (B, T) padding mask
  (flash attention) or a (B, 1, 1, T) key mask (the engine's attention, `engine.attention.hf`) -> columns
  0..end; None (SDPA with a purely causal mask, which transformers leaves to `is_causal`, upper-left
  aligned and so wrong for a chunk) -> the chunk's lower-right causal rows; None under flash or the
  engine's attention (lower-right aligned already) -> None;
- `position_ids` (..., T) -> (..., start:end); `cache_position` (T,) -> start:end;
- `position_embeddings`: each tensor (..., T, D) -> (..., start:end, D), in a tuple or a dict by rotary type;
- `prev_topk_indices` (B, T, k), the key positions an earlier layer's sparse-attention indexer picked for
  each query (GLM-5's shared DSA layers) -> rows start..end, a position past the chunk's keys (end or later)
  replaced by the query's own: the top-k takes such a masked key only once every key the query sees is
  taken, its own included, and a masked one stays masked (`key_indices_rows`);
- a per-token input, any other tensor of shape (B, T, ...) like the hidden states (Gemma 4's
  `per_layer_input`) -> (B, start:end, ...), as the hidden states are cut; where it requires grad
  (`LayerCall.graded`) the layer's function takes it as an input and returns its gradient;
- any other argument passes unchanged, and is refused by name when it is a tensor with an axis of T
  (a per-token input whose cut is not known) or one that requires grad (its gradient would be lost).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass
from functools import partial
from typing import Any

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.engine.attention.hf import ENGINE_ATTENTION

CACHE_NAMES = ("cache", "past_key_values", "past_key_value")
"""Names transformers gives a decoder layer's cache argument."""
POSITIONS = ("position_ids",)
"""Arguments whose last axis is the sequence."""
KEY_INDICES = ("prev_topk_indices",)
"""Arguments holding key positions (B, T, k) per query."""
CUT_OTHERWISE = ("attention_mask", "cache_position", "position_embeddings", *POSITIONS, *KEY_INDICES)
"""Arguments cut by their own rule, never as a per-token input."""


@dataclass(frozen=True)
class LayerCall:
    """A decoder layer's call: its class's forward, the layer, and every argument but the hidden states."""

    layer: nn.Module
    forward: Callable
    arguments: dict[str, Any]
    cache_name: str
    length: int
    """T, the sequence length of the call."""
    batch: int = 0
    """B, the batch size of the call (a per-token input's leading axes are (B, T))."""

    @classmethod
    def of(cls, function: partial, args: tuple) -> LayerCall:
        """The call transformers' checkpoint entry hands over: `function` = partial(forward, layer,
        **kwargs), `args` = (hidden_states (B, T, d), *rest); the rest bound to their names."""
        forward, (layer,), kwargs = function.func, function.args, dict(function.keywords)
        names = [p.name for p in inspect.signature(forward).parameters.values()
                 if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        family = type(layer).__name__
        if len(args) > len(names) - 1:
            raise ConfigError(f"streambp: {family}.forward takes more positional arguments than it names")
        kwargs |= dict(zip(names[2:], args[1:], strict=False))
        cache_name = next((name for name in CACHE_NAMES if name in names or name in kwargs), None)
        if cache_name is None:
            raise ConfigError(f"streambp: {family}.forward takes no cache argument "
                              f"({', '.join(CACHE_NAMES)}), through which the generic stream hands its "
                              "attention the prefix's keys and values")
        batch, length = args[0].shape[:2]
        return cls(layer, forward, kwargs, cache_name, length, batch)

    def per_token(self, value: Any) -> bool:
        """Whether `value` is a per-token input: a tensor of shape (B, T, ...), cut as the hidden states."""
        return isinstance(value, Tensor) and value.dim() >= 2 and tuple(value.shape[:2]) == (self.batch,
                                                                                                self.length)

    @property
    def graded(self) -> tuple[str, ...]:
        """The names of the per-token inputs that require grad, which the layer's function takes and
        returns the gradient of."""
        return tuple(name for name, value in self.arguments.items()
                     if name not in CUT_OTHERWISE and self.per_token(value) and value.requires_grad)

    def run(self, hidden: Tensor, cache, arguments: dict[str, Any] | None = None):
        """The layer's own forward on `hidden` with `cache` and `arguments` (default: the whole call's)."""
        arguments = self.arguments if arguments is None else arguments
        return self.forward(self.layer, hidden, **{**arguments, self.cache_name: cache})

    def chunk(self, start: int, end: int, implementation: str, device: torch.device) -> dict[str, Any]:
        """The arguments of query positions start..end against keys 0..end (module docstring), for the
        attention `implementation` (transformers' `_attn_implementation`) on `device`."""
        return {name: self._cut(name, value, start, end, (implementation, device))
                for name, value in self.arguments.items()}

    def _cut(self, name: str, value: Any, start: int, end: int, attention: tuple[str, torch.device]) -> Any:
        if name == "attention_mask":
            return mask_rows(value, start, end, self.length, *attention)
        if name in POSITIONS and isinstance(value, Tensor):
            return value[..., start:end]
        if name == "cache_position" and isinstance(value, Tensor):
            return value[start:end]
        if name == "position_embeddings":
            return _cut_rows(value, start, end, self.length, name)
        if name == self.cache_name or name == "use_cache":
            return value
        if name in KEY_INDICES and self.per_token(value):
            return key_indices_rows(value, start, end)
        if self.per_token(value):
            return value[:, start:end]
        self._check_passes(name, value)
        return value

    def _check_passes(self, name: str, value: Any) -> None:
        """ConfigError for an argument that cannot pass to a chunk unchanged (module docstring)."""
        what = f"streambp: argument {name!r} of {type(self.layer).__name__}"
        for tensor in _tensors(value):
            if tensor.requires_grad:
                raise ConfigError(f"{what} requires grad, which the generic stream's layer function does not "
                                  "carry back")
            if self.length in tensor.shape[1:] or (tensor.dim() == 1 and tensor.shape[0] == self.length):
                raise ConfigError(f"{what} has a sequence axis (shape {tuple(tensor.shape)}) the generic "
                                  "stream does not know how to cut")


def layer_outputs(returned: Any) -> tuple[Tensor | None, ...] | None:
    """A layer's return as a tuple (the hidden states first, then tensors or None); None when it is not
    one."""
    outputs = returned if isinstance(returned, tuple) else (returned,)
    if not isinstance(outputs[0], Tensor) or not all(t is None or isinstance(t, Tensor) for t in outputs):
        return None
    return outputs


def _tensors(value: Any) -> list[Tensor]:
    if isinstance(value, Tensor):
        return [value]
    if isinstance(value, tuple | list):
        return [t for item in value for t in _tensors(item)]
    if isinstance(value, dict):
        return [t for item in value.values() for t in _tensors(item)]
    return []


def _cut_rows(value: Any, start: int, end: int, length: int, name: str) -> Any:
    """Each tensor of `value` (a tensor, or a nested tuple or dict: DeepSeek-V4's cos and sin of each rotary
    type by name) cut to rows start..end of its axis -2."""
    if isinstance(value, dict):
        return {key: _cut_rows(item, start, end, length, name) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return type(value)(_cut_rows(item, start, end, length, name) for item in value)
    if isinstance(value, Tensor):
        if value.dim() < 2 or value.shape[-2] != length:
            raise ConfigError(f"streambp: {name} of shape {tuple(value.shape)} has no sequence axis of "
                              f"{length}")
        return value[..., start:end, :]
    return value


def key_indices_rows(indices: Tensor, start: int, end: int) -> Tensor:
    """Rows start..end of the key positions (B, T, k), each position past key end - 1 replaced by its
    query's own (module docstring): every index a valid column of the chunk's (B, end - start, end) mask."""
    rows = indices[:, start:end]
    own = torch.arange(start, end, device=rows.device, dtype=rows.dtype)[None, :, None]
    return torch.where(rows < end, rows, own)


def mask_rows(mask: Any, start: int, end: int, length: int, implementation: str, device: torch.device) -> Any:
    """The attention mask of query rows start..end against keys 0..end (module docstring)."""
    if mask is None:
        if implementation.startswith(("flash", ENGINE_ATTENTION)):
            return None  # flash's and the engine's causal masks are lower-right aligned: right for a chunk
        return causal_rows(start, end, implementation, device)
    if not isinstance(mask, Tensor):
        raise ConfigError(f"streambp: the attention mask is a {type(mask).__name__} (attention "
                          f"implementation {implementation!r}), which the generic stream cannot cut into "
                          "chunks; use eager or sdpa")
    if mask.dim() == 2 and mask.shape[-1] == length:
        return mask[:, :end]
    if mask.dim() == 4 and mask.shape[-2:] == (1, length):
        return mask[..., :end]
    if mask.dim() == 4 and mask.shape[-2:] == (length, length):
        return mask[..., start:end, :end]
    raise ConfigError(f"streambp: an attention mask of shape {tuple(mask.shape)} for {length} tokens cannot "
                      "be cut into chunks")


def causal_rows(start: int, end: int, implementation: str, device: torch.device) -> Tensor:
    """(1, 1, end - start, end) lower-right causal mask for SDPA: bool, True attends (transformers' eager
    attention always gets a mask tensor, never None)."""
    rows = torch.arange(start, end, device=device)[:, None] >= torch.arange(end, device=device)[None]
    if implementation == "sdpa":
        return rows[None, None]
    raise ConfigError(f"streambp: no attention mask for attention implementation {implementation!r}, which "
                      "the generic stream cannot rebuild for a chunk; use sdpa")
