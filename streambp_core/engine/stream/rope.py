"""Rotary position embeddings (RoPE) as the streamed layer applies them, and their transpose for the
backward of the K/V projections: the same values as transformers' `apply_rotary_pos_emb`, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rope:
    """RoPE tables of a sequence laid out for heads on dim 1: cos, sin (B, 1, T, rd), and `sign` (rd,),
    -1 on the first half and +1 on the second, so that transformers' rotate_half(t) = cat(-t2, t1) is
    roll(t, rd / 2) * sign: two ops instead of four, bit for bit the same values. With `on` false the
    layer has no RoPE (SmolLM3's NoPE layers): Q and K pass unrotated. A table narrower than the head
    (rd < hd, the `partial_rotary_factor` of Phi-3 and GLM) rotates the first rd features and passes the rest.
    `interleaved`: pairs (2i, 2i + 1) rotate together (GLM-4, ERNIE 4.5: the tables repeat each of their
    first half's entries twice, as transformers' interleaved `apply_rotary_pos_emb` does); `in_float32`:
    the rotation computes in float32 and rounds back to the input's precision (ERNIE 4.5). Tables wider than
    the activations (OLMo 2 and 3 keep theirs in float32 whatever the model's precision) rotate in the wider
    type and round back to the activations' (`work_dtype`), as their `apply_rotary_pos_emb` does.
    `as_complex`: cos and sin are the real and imaginary parts of Llama 4's `freqs_cis` (B, 1, T, hd / 2),
    and each pair (2i, 2i + 1) of a head, as a complex number in float32, is multiplied by it
    (`apply_rotary_emb`, in its own layout, so the same kernels give the same bits). `query_scale`
    (1, 1, T, 1) float32, or None: Llama 4's attention temperature of a NoPE layer's queries
    (`scale_queries`)."""

    cos: Tensor
    sin: Tensor
    sign: Tensor
    on: bool = True
    interleaved: bool = False
    in_float32: bool = False
    as_complex: bool = False
    query_scale: Tensor | None = None

    @classmethod
    def of(cls, cos: Tensor, sin: Tensor, on: bool = True, *, interleaved: bool = False,
           in_float32: bool = False, as_complex: bool = False) -> Rope:
        """From transformers' (B, T, rd) tables; `on`: whether the layer rotates Q and K at all."""
        if interleaved:
            half = cos.shape[-1] // 2
            cos, sin = cos[..., :half].repeat_interleave(2, -1), sin[..., :half].repeat_interleave(2, -1)
        sign = cos.new_ones(cos.shape[-1])
        sign[: cos.shape[-1] // 2] = -1
        return cls(cos.unsqueeze(1), sin.unsqueeze(1), sign, on, interleaved, in_float32, as_complex)

    @classmethod
    def of_layer(cls, cos: Tensor, sin: Tensor, parts, offset: int = 0) -> Rope:
        """The tables as the layer of `parts` (`LayerParts`) applies them (with its query temperature, at
        sequence indices offset.. : a sequence-parallel shard's global ones)."""
        rope = cls.of(cos, sin, parts.rotary, interleaved=parts.rope_interleaved,
                      in_float32=parts.rope_in_float32, as_complex=parts.rope_complex)
        if parts.query_temperature is None:
            return rope
        scale = temperature_table(cos.shape[1], *parts.query_temperature, cos.device, offset)
        return replace(rope, query_scale=scale)

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE turns (the head dimension, or less with partial rotary)."""
        return self.cos.shape[-1]

    def chunk(self, start: int, end: int) -> Rope:
        """The tables of positions start..end."""
        scale = None if self.query_scale is None else self.query_scale[:, :, start:end]
        return replace(self, cos=self.cos[:, :, start:end], sin=self.sin[:, :, start:end], query_scale=scale)


def temperature_table(length: int, floor_scale: float, attn_scale: float, device, offset: int = 0) -> Tensor:
    """(1, 1, T, 1) float32: log1p(floor((t + 1) / floor_scale)) * attn_scale + 1 at each index t of the
    sequence (not its position id, padded or packed alike), as Llama 4's NoPE layers compute it (their
    temperature tuning after arXiv 2501.19399); t from `offset` (a sequence-parallel shard's first index)."""
    positions = torch.arange(offset, offset + length, device=device)
    scales = torch.log1p(torch.floor((positions.float() + 1.0) / floor_scale)) * attn_scale + 1.0
    return scales.view(1, 1, length, 1)


def scale_queries(q: Tensor, rope: Rope) -> Tensor:
    """Queries (B, H, c, hd) scaled by the chunk's attention temperature, rounded back to their precision as
    transformers does; q itself without one."""
    if rope.query_scale is None:
        return q
    return (q * rope.query_scale).to(q.dtype)


def rotate_half(t: Tensor, rope: Rope) -> Tensor:
    """transformers' rotate_half of t (..., rd), or its interleaved one, stack(-t[1::2], t[::2])."""
    if rope.interleaved:
        return torch.stack((-t[..., 1::2], t[..., ::2]), dim=-1).flatten(-2)
    return torch.roll(t, t.shape[-1] // 2, -1).mul_(rope.sign)


def rotate(t: Tensor, rope: Rope) -> Tensor:
    """RoPE as transformers applies it: t * cos + rotate_half(t) * sin (heads on dim 1) on the first rd
    features; t in a layer without RoPE."""
    return _on_rotary_features(t, rope, transpose=False)


def _complex_product(t: Tensor, rope: Rope, conjugate: bool) -> Tensor:
    """t (B, heads, c, hd) with each pair (2i, 2i + 1) times the complex table (or its conjugate: the
    rotation's transpose, as autograd takes it), in float32 and in transformers' layout (B, c, heads, hd)."""
    freqs = torch.complex(rope.cos, rope.sin).transpose(1, 2)  # (B, c, 1, hd / 2)
    work = t.transpose(1, 2)
    pairs = torch.view_as_complex(work.float().unflatten(-1, (-1, 2)))  # an empty chunk too
    out = torch.view_as_real(pairs * (freqs.conj() if conjugate else freqs)).flatten(3)
    return out.type_as(t).transpose(1, 2)


def work_dtype(t: Tensor, rope: Rope) -> torch.dtype:
    """The precision the rotation of t computes in: float32 for a family that rotates in float32, else
    the wider of t's and the tables' (float32 tables meeting bfloat16 activations: float32)."""
    return torch.float32 if rope.in_float32 else torch.promote_types(t.dtype, rope.cos.dtype)


def _rotate(t: Tensor, rope: Rope) -> Tensor:
    work = work_dtype(t, rope)
    if work == t.dtype == rope.cos.dtype:
        return t * rope.cos + rotate_half(t, rope) * rope.sin
    return (t.to(work) * rope.cos + rotate_half(t, rope).to(work) * rope.sin).to(t.dtype)


def rope_transpose(grad: Tensor, rope: Rope) -> Tensor:
    """dL/dk of rotated = k * cos + rotate_half(k) * sin (heads on dim 1); grad in a layer without RoPE.
    Rotated in a wider type (`work_dtype`), each of the two terms is rounded back to grad's precision
    before their sum, as autograd takes that rotation's backward."""
    return _on_rotary_features(grad, rope, transpose=True)


def _on_rotary_features(t: Tensor, rope: Rope, transpose: bool) -> Tensor:
    """The rotation (or its transpose) of t's first rd features, the rest as they are; t without RoPE."""
    if not rope.on:
        return t
    if rope.as_complex:
        return _complex_product(t, rope, conjugate=transpose)
    turn = _transpose if transpose else _rotate
    dim = rope.cos.shape[-1]
    if dim < t.shape[-1]:
        return torch.cat([turn(t[..., :dim], rope), t[..., dim:]], dim=-1)
    return turn(t, rope)


def _transpose(grad: Tensor, rope: Rope) -> Tensor:
    work = work_dtype(grad, rope)
    if work == grad.dtype == rope.cos.dtype:
        return grad * rope.cos - rotate_half(grad * rope.sin, rope)
    wide = grad.to(work)
    return (wide * rope.cos).to(grad.dtype) - rotate_half((wide * rope.sin).to(grad.dtype), rope)
