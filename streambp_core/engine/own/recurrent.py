"""The model's own decoder layers that mix tokens without keys and values, streamed: a recurrent mixer
(Mamba2's SSD in Nemotron-H and Granite 4.0) carries its state and conv halo across chunk boundaries, a
short-conv mixer (LFM2's gated depthwise conv) its conv halo alone, and a token-wise block (Nemotron-H's
MLP and MoE blocks) is cut into chunks as it stands.

transformers' Mamba2 mixers (`NemotronHMamba2Mixer`, `GraniteMoeHybridMambaLayer`), per chunk s..e of
the normed, padding-masked input: in_proj -> [gate, xBC, dt]; a causal depthwise conv of kernel K over xBC
(its output at t reads the inputs t - K + 1..t); the SSD scan (h_t = exp(dt_t A) h_{t-1} + dt_t B_t x_t,
y_t = C_t h_t + D x_t); the gated RMSNorm and out_proj. A chunk depends on what precedes it only through
the state h before s (B, heads, head_dim, state) and the conv's halo, the K - 1 conv inputs before s. The
mixer reads both from its cache and writes the chunk's final ones there (transformers' linear-attention
Cache API: `get_conv_state`, `update_conv_state`, `get_recurrent_state`, `update_recurrent_state`), which
`StateCache` answers, duck-typed, for one chunk. LFM2's short conv (`Lfm2ShortConv`: in_proj -> [b, c, x];
c * conv(b * x); out_proj) has no recurrent state: it writes its halo alone, and only the halo is carried.

Per layer (`OwnLayer` holds the layer's input alone between the passes), backward:
1. the boundaries: the layer's forward without grad on chunks first to last but the last, each from the
   state and halo the chunk before left (none before the first: transformers' zeros);
2. chunks last to first: the chunk's forward under autograd from its boundary's state and halo (leaves);
   back-propagate at once its output gradient and the gradients of its final state and halo (carried from
   the chunk after it); the leaves' gradients are carried to the chunk before, the input's written into
   its slice, the parameters' accumulate in `.grad`.
A token-wise block has no boundary: step 2 alone, on slices. The recurrent layer's padding mask (a (B, T)
mask, transformers' `create_recurrent_attention_mask`) is cut to the chunk's columns s..e, so left and
right padding stream as the whole sequence runs. A trailing one-token chunk joins the chunk before it:
transformers' one-token step updates its state in place, which autograd cannot take back.
"""

from __future__ import annotations

import torch
from torch import Tensor
from torch.nn import functional as F

from streambp_core.config import ConfigError
from streambp_core.engine.chunks import backward_into, chunk_bounds, grad_or_zeros, leaf
from streambp_core.engine.own.arguments import LayerCall, layer_outputs
from streambp_core.engine.own.cache import PrefixCache

ATTENTION, RECURRENT, TOKEN_WISE = "attention", "recurrent", "token-wise"
PARALLEL = "attention and recurrent"
"""How a decoder layer mixes tokens, as its whole-sequence forward showed (`mixing`)."""
TOKEN_WISE_BLOCKS = ("mlp", "moe")
"""`block_type`s of transformers' one-mixer blocks (Nemotron-H) that mix no tokens."""


class StateCache(PrefixCache):
    """A chunk's cache: the prefix's keys and values (`PrefixCache`), and for a recurrent mixer the state
    and conv halo before the chunk (None: the sequence's start), with the ones after it it writes."""

    def __init__(self, state: Tensor | None = None, halo: Tensor | None = None,
                 prefix: tuple[Tensor, Tensor] | None = None) -> None:
        empty = torch.empty(0, 0)
        super().__init__(*(prefix or (empty, empty)))
        self.state, self.halo = state, halo
        self.final_state: Tensor | None = None
        """(B, heads, head_dim, state): the recurrent state after the chunk."""
        self.final_halo: Tensor | None = None
        """(B, conv_dim, K - 1): the conv inputs of the chunk's last K - 1 positions."""

    @property
    def wrote_state(self) -> bool:
        return self.final_state is not None or self.final_halo is not None

    def get_conv_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        _one_state(state_idx)
        return self.halo

    def update_conv_state(self, conv_states: Tensor, layer_idx: int, state_idx: int = 0,
                          conv_kernel_size: int | None = None, **kwargs) -> Tensor:
        """[halo, the chunk's conv inputs (B, conv_dim, c)] for the conv to read; keeps the next halo."""
        _one_state(state_idx)
        if conv_kernel_size is None:
            raise ConfigError("streambp: a recurrent mixer updates its conv state without its kernel size, "
                              "from which the streamed halo is cut")
        full = conv_states if self.halo is None else torch.cat([self.halo, conv_states], dim=-1)
        width = conv_kernel_size - 1
        tail = full[..., full.shape[-1] - min(width, full.shape[-1]):]
        self.final_halo = F.pad(tail, (width - tail.shape[-1], 0))  # zeros before the sequence's start
        return full

    def get_recurrent_state(self, layer_idx: int, state_idx: int = 0) -> Tensor | None:
        _one_state(state_idx)
        return self.state

    def update_recurrent_state(self, recurrent_states, layer_idx: int, state_idx: int = 0, **kwargs):
        _one_state(state_idx)
        if not isinstance(recurrent_states, Tensor):
            raise ConfigError("streambp: a recurrent mixer wrote intermediate states to its cache, which the "
                              "streamed state does not take")
        self.final_state = recurrent_states
        return recurrent_states

    def get_recurrent_states_to_keep(self, layer_idx: int | None = None) -> int:
        return 0

    def is_recording_past(self, layer_idx: int) -> bool:
        return False


def _one_state(state_idx: int) -> None:
    if state_idx != 0:
        raise ConfigError("streambp: a recurrent mixer with more than one conv or recurrent state per layer "
                          "is not streamed")


def mixing(call: LayerCall, cache: StateCache) -> str:
    """How `call`'s layer mixes tokens, from what its whole-sequence forward wrote to `cache`; ConfigError
    for a layer the stream cannot carry."""
    family = type(call.layer).__name__
    keys = cache.chunk_keys is not None
    if cache.wrote_state and cache.final_halo is None:
        raise ConfigError(f"streambp: {family} writes a recurrent state to its cache without a conv state, "
                          "which the streamed recurrence does not carry")
    if keys:
        return PARALLEL if cache.wrote_state else ATTENTION  # PARALLEL: `engine.own.parallel`
    if cache.wrote_state:
        return RECURRENT
    if getattr(call.layer, "block_type", None) in TOKEN_WISE_BLOCKS:
        return TOKEN_WISE
    raise ConfigError(f"streambp: {family} does not write its keys and values through the cache, from which "
                      "the generic stream takes the prefix's")


def recurrent_bounds(length: int, partition_size: int) -> list[tuple[int, int]]:
    """`chunk_bounds`, with a trailing one-token chunk joined to the chunk before (module docstring)."""
    bounds = list(chunk_bounds(length, partition_size, None))
    if len(bounds) > 1 and bounds[-1][1] - bounds[-1][0] == 1:
        bounds[-2:] = [(bounds[-2][0], bounds[-1][1])]
    return bounds


def _arguments(call: LayerCall, start: int, end: int, implementation: str, device) -> dict:
    """The chunk's arguments, its padding mask (B, T) cut to columns start..end. A layer whose mixer reads
    its padding mask under another name (Qwen4-Exp's `conv_mask`, a per-token input cut as the hidden
    states, None without padding) keeps its attention mask as `LayerCall.chunk` cuts it."""
    arguments = call.chunk(start, end, implementation, device)
    own_mask = any(name.endswith("mask") and (value is None or call.per_token(value))
                   for name, value in call.arguments.items() if name != "attention_mask")
    if "attention_mask" in call.arguments and not own_mask:
        mask = call.arguments["attention_mask"]
        if mask is not None and not (isinstance(mask, Tensor) and mask.dim() == 2):
            raise ConfigError(f"streambp: {type(call.layer).__name__}'s recurrent mixer gets a mask of shape "
                              f"{tuple(getattr(mask, 'shape', ()))}, not a (batch, tokens) padding mask")
        arguments["attention_mask"] = None if mask is None else mask[:, start:end]
    return arguments


def _boundaries(call: LayerCall, hidden: Tensor, bounds, implementation: str) -> list[tuple]:
    """(state, halo) before each chunk (module docstring, step 1)."""
    boundaries = [(None, None)]
    with torch.no_grad():
        for start, end in bounds[:-1]:
            cache = StateCache(*boundaries[-1])
            call.run(hidden[:, start:end], cache, _arguments(call, start, end, implementation, hidden.device))
            boundaries.append((cache.final_state, cache.final_halo))
    return boundaries


def state_backward(call: LayerCall, kind: str, partition_size: int, implementation: str, hidden: Tensor,
                   grad_out: Tensor, params) -> Tensor:
    """dL/d(the layer's input) (B, T, d) of a recurrent or token-wise layer; the parameters' gradients land
    in `.grad` (module docstring, step 2)."""
    bounds = recurrent_bounds(call.length, partition_size)
    boundaries = _boundaries(call, hidden, bounds, implementation) if kind == RECURRENT \
        else [(None, None)] * len(bounds)
    grad_in = torch.empty_like(hidden)
    carried: list[Tensor] = []  # the gradients of the final state and halo of the chunk being taken
    for (start, end), boundary in zip(reversed(bounds), reversed(boundaries), strict=True):
        h = leaf(hidden[:, start:end])
        before = [None if t is None else leaf(t) for t in boundary]  # (state, halo); no state: a short conv
        cache = StateCache(*before)
        with torch.enable_grad():
            output = layer_outputs(call.run(h, cache, _arguments(call, start, end, implementation,
                                                                 hidden.device)))[0]
        written = [t for t in (cache.final_state, cache.final_halo) if t is not None] if carried else []
        taken = [t for t in before if t is not None]
        backward_into([output, *written], [grad_out[:, start:end], *carried], [h, *taken], params)
        grad_in[:, start:end] = grad_or_zeros(h)
        carried = [grad_or_zeros(t) for t in taken]
    return grad_in
