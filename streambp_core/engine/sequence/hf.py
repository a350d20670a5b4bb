"""Sequence-parallel attention as a transformers attention implementation, for the methods that run the
model's own forward (plain, checkpoint, mst) on this rank's shard of the sequence.

`sequence_attention(model, group, backend)` registers one project-named implementation and sets it on
this model only (`set_attn_implementation`); the group it attends over is an attribute of this model's
attention modules, set for the block and removed after, so nothing process-wide changes and two models
(or two groups) never share state. Each attention call receives the shard's q, k, v (B, H, T_r, hd) and,
as its attention mask, the key validity of the whole sequence (B, 1, 1, T) (`sequence_mask_argument`),
which tells it the sequence's length; the keys and values are gathered (`sequence_attention.gather_kv`)
and the shard's queries attend through `gathered_attention`: six all-to-alls per layer and step, three in
the forward and three in the backward (and three more per recompute of a checkpointed layer).

The layer's own attention arguments go with them: a soft-cap (`softcap`, Gemma 2) and attention sinks
(`s_aux`, gpt-oss; each rank takes its heads' slice). A chunked local layer (Llama 4's) attends within
chunks counted over the whole sequence. Llama 4's NoPE layers scale their queries by their index in the
sequence, which transformers counts from 0 in each forward, the shard's: while the block is open, those
modules leave the temperature to this function (`attn_temperature_tuning` off), which applies it at the
shard's global indices, as the module computes it (`rope.temperature_table`).
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import Tensor, nn

from streambp_core.engine.chunks import local_chunks
from streambp_core.engine.sequence.attention import (
    BlockAttention,
    gather_kv,
    gathered_attention,
    kv_replication,
    whole_shards,
)
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.engine.stream.rope import temperature_table
from streambp_core.models.adapters import layer_chunk, query_temperature

SEQUENCE_ATTENTION = "streambp_sequence"
"""The implementation's name in transformers' attention registry."""
GROUP_ATTRIBUTE = "_streambp_sequence_group"
"""Where an attention module holds its (group, KV copies, backend, query temperature or None) while a
sequence-parallel run is open."""
TEMPERATURE_FLAG = "attn_temperature_tuning"
"""The Llama 4 attention module's switch for its query temperature, off while the block is open."""


def sequence_attention_forward(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                               attention_mask: Tensor | None, scaling: float | None = None,
                               dropout: float = 0.0, sliding_window: int | None = None,
                               s_aux: Tensor | None = None, softcap: float | None = None,
                               **kwargs) -> tuple[Tensor, None]:
    """transformers' attention-function signature: this rank's shard of queries attends to the whole
    sequence; returns (B, T_r, H, hd_v), the value heads' width (DeepSeek-V3's differs from its query/key
    heads': keys and values travel side by side at their own widths, `gather_kv`). `s_aux`: the layer's
    attention sinks (H,); `softcap`: its scores' soft-cap (module docstring)."""
    if dropout:
        raise ValueError("sequence-parallel attention has no dropout; build the model with "
                         "attention_dropout=0")
    group, copies, backend, temperature = getattr(module, GROUP_ATTRIBUTE)
    key_valid = attention_mask[:, 0, 0]  # (B, T): the whole sequence's keys (`sequence_mask_argument`)
    total = key_valid.shape[-1]
    if temperature is not None:
        start, end = group.shard_bounds(total)
        scales = temperature_table(end - start, *temperature, query.device, start)
        query = (query * scales).to(query.dtype)  # as the module scales it, at the global indices
    keys, values = gather_kv(key, value, group, total, copies)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    valid = None if key_valid.stride(-1) == 0 else key_valid  # no padding (`sequence_mask_argument`)
    local = local_chunks(layer_chunk(module), valid, None, (query.shape[0], total), query.device)
    how = BlockAttention(scale, backend, sliding_window, sinks=s_aux, softcap=softcap, local=local)
    out = gathered_attention(query, keys, values, valid, whole_shards(group, total), how)
    return out.transpose(1, 2), None


def register_sequence_attention() -> str:
    """Register the implementation with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    AttentionInterface.register(SEQUENCE_ATTENTION, sequence_attention_forward)
    return SEQUENCE_ATTENTION


@contextmanager
def sequence_attention(model: nn.Module, attention_modules: list[nn.Module], group: SequenceGroup,
                       num_heads: int, num_kv_heads: int, backend: str = "auto"):
    """Within the block, `model`'s `attention_modules` attend over `group`; the model's own setting is
    restored after. ConfigError when the heads cannot split over the ranks (`kv_replication`)."""
    copies = kv_replication(num_heads, num_kv_heads, group.size)
    original = model.config._attn_implementation
    tuned = [module for module in attention_modules if query_temperature(module) is not None]
    for module in attention_modules:
        setattr(module, GROUP_ATTRIBUTE, (group, copies, backend, query_temperature(module)))
    try:
        for module in tuned:
            setattr(module, TEMPERATURE_FLAG, False)
        model.set_attn_implementation(register_sequence_attention())
        yield model
    finally:
        model.set_attn_implementation(original)
        for module in tuned:
            setattr(module, TEMPERATURE_FLAG, True)
        for module in attention_modules:
            if GROUP_ATTRIBUTE in vars(module):
                delattr(module, GROUP_ATTRIBUTE)


def sequence_mask_argument(key_valid: Tensor | None, batch_size: int, total_tokens: int,
                           device: torch.device) -> Tensor:
    """The attention-mask argument (B, 1, 1, T) bool that transformers passes unchanged to each layer:
    `key_valid` (B, T), or for a batch without padding (None) an expanded view of one True (stride 0,
    which the attention reads as no mask), so the whole sequence's length always arrives."""
    if key_valid is None:
        one = torch.ones((1, 1, 1, 1), dtype=torch.bool, device=device)
        return one.expand(batch_size, 1, 1, total_tokens)
    return key_valid.bool()[:, None, None, :]
