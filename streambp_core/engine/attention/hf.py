"""The engine's prefix attention as a transformers attention implementation, so the baselines can run the
same kernel as StreamBP (fair comparisons) and run on the meta device (simulation) without a T x T mask.

Under it, a baseline passes the attention mask as the key validity shaped (B, 1, 1, T): every transformers
mask builder returns a 4D mask unchanged, for full and sliding layers alike, so each layer receives it
(or None) and no T x T mask is ever built. A sliding layer's window arrives as transformers'
`sliding_window` argument. A chunked local layer (Llama 4's) attends a block of whole chunks of queries at
a time (`local_attention`), so it too builds no T x T mask.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch
from torch import Tensor, nn

from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import chunk_bounds, local_chunks
from streambp_core.models.adapters import layer_chunk, layer_window

ENGINE_ATTENTION = "streambp_prefix"


def engine_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    sliding_window: int | None = None,
    s_aux: Tensor | None = None,
    softcap: float | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature over `prefix_attention`; returns (B, T, H, hd).

    `backend` is the CUDA kernel choice (auto, sdpa, flash), bound when the function is registered;
    `sliding_window` is the layer's window (None: full causal attention, or for a module that leaves its
    window to the mask builder, Qwen2-MoE's, the window `layer_window` reads from it); `s_aux` the
    layer's attention sinks (H,), as gpt-oss passes them, or None; `softcap` the layer's attention logit
    soft-cap (Gemma 2), applied as transformers' eager attention applies it.
    """
    if dropout:
        raise ValueError("the engine attention has no dropout; build the model with attention_dropout=0")
    key_valid = _key_valid(attention_mask)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    window = layer_window(module) if sliding_window is None else sliding_window
    chunk = layer_chunk(module)
    if chunk is not None:
        return local_attention(query, key, value, key_valid, scale, backend, chunk).transpose(1, 2), None
    out = prefix_attention(query, key, value, key_valid, scale, backend, window, sinks=s_aux, softcap=softcap)
    return out.transpose(1, 2), None


LOCAL_BLOCK_TOKENS = 256
"""Queries a chunked local layer attends at once when its chunks are shorter: whole chunks, each query
masked to its own, so a chunk of 1 position is T / 256 kernel calls, not T (a 2-layer toy's max-len search
took minutes)."""


def local_attention(q: Tensor, k: Tensor, v: Tensor, key_valid: Tensor | None, scale: float, backend: str,
                    size: int) -> Tensor:
    """Chunked local attention (B, H, T, hd) of a whole sequence, a block of whole chunks of `size` queries
    at a time (at least `LOCAL_BLOCK_TOKENS` queries, each masked to its own chunk) against the keys their
    chunks reach (`chunks.LocalChunks`: counted from each row's first real token,
    or in packed rows from each document's start, as transformers' mask counts them)."""
    if q.shape[2] != k.shape[2]:
        raise ValueError("the engine attention's chunked local layers take the whole sequence (no cache)")
    packed = key_valid is not None and key_valid.dim() == 3
    positions = None
    if packed:  # a packed row's position counts from its document's first key
        positions = torch.arange(q.shape[2], device=q.device) - key_valid.int().argmax(dim=-1)
    local = local_chunks(size, None if packed else key_valid, positions, (q.shape[0], q.shape[2]), q.device)
    outs = []
    for start, end in chunk_bounds(q.shape[2], max(size, LOCAL_BLOCK_TOKENS // size * size)):
        first = local.first_key(start)
        if key_valid is None:
            valid = None
        else:
            valid = key_valid[:, start:end, first:end] if packed else key_valid[:, first:end]
        outs.append(prefix_attention(q[:, :, start:end], k[:, :, first:end], v[:, :, first:end],
                                     local.narrow(valid, start, end, first), scale, backend))
    return torch.cat(outs, dim=2)


def _key_valid(attention_mask: Tensor | None) -> Tensor | None:
    """(B, T) key validity from the (B, 1, 1, T) mask of `engine_mask_argument` (or a (B, T) one); (B, T, T)
    from a packed rows' per-document mask."""
    if attention_mask is None or attention_mask.dim() == 2:
        return attention_mask
    key_shaped = attention_mask.dim() == 4 and attention_mask.shape[1:3] == (1, 1)
    if key_shaped and attention_mask.dtype == torch.bool:
        return attention_mask[:, 0, 0]
    if attention_mask.dim() == 4 and attention_mask.shape[1] == 1 and attention_mask.dtype == torch.bool:
        return attention_mask[:, 0]  # packed rows: each query's own document (`engine.packing`)
    raise ValueError("the engine attention takes a (batch, 1, 1, seq_len) boolean key mask or a "
                     "(batch, 1, seq_len, seq_len) per-document one, not an additive mask")


ENGINE_ATTENTION_NAMES = {"auto": ENGINE_ATTENTION, "sdpa": f"{ENGINE_ATTENTION}_torch",
                          "flash": f"{ENGINE_ATTENTION}_fa"}
"""The name the engine attention registers under for each kernel choice. transformers dispatches on
substrings of an implementation's name: one containing "flash" loads a flash kernel, one containing "sdpa"
runs the model's SDPA support check (gpt-oss and Gemma 2 declare none, so `--attn sdpa` raised there), one
containing "flex" its flex check; so no name here contains any of them (`TRANSFORMERS_MARKERS`)."""
TRANSFORMERS_MARKERS = ("flash", "sdpa", "flex", "paged", "/")
"""Substrings of an attention implementation's name that transformers acts on."""


def register_engine_attention(backend: str = "auto") -> str:
    """Register the engine attention with `backend` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    name = ENGINE_ATTENTION_NAMES[backend]
    AttentionInterface.register(name, functools.partial(engine_attention_forward, backend=backend))
    return name


@contextmanager
def engine_attention(model: nn.Module, backend: str = "auto"):
    """Within the block, `model` attends through the engine kernel; its own setting is restored after."""
    original = model.config._attn_implementation
    model.set_attn_implementation(register_engine_attention(backend))
    try:
        yield model
    finally:
        model.set_attn_implementation(original)


def engine_mask_argument(key_valid: Tensor | None) -> Tensor | None:
    """The attention-mask argument that makes transformers pass `key_valid` straight to each layer."""
    return None if key_valid is None else key_valid[:, None, None, :]
