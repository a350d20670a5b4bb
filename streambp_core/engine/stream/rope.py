"""Rotary position embeddings (RoPE) as the streamed layer applies them, and their transpose for the
backward of the K/V projections: the same values as transformers' `apply_rotary_pos_emb`, bit for bit."""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


@dataclass(frozen=True)
class Rope:
    """RoPE tables of a sequence laid out for heads on dim 1: cos, sin (B, 1, T, hd), and `sign` (hd,),
    -1 on the first half and +1 on the second, so that transformers' rotate_half(t) = cat(-t2, t1) is
    roll(t, hd / 2) * sign: two ops instead of four, bit for bit the same values. With `on` false the
    layer has no RoPE (SmolLM3's NoPE layers): Q and K pass unrotated. Tables narrower than the heads
    (partial rotary, Phi-3's `partial_rotary_factor`) turn the first `rotary_dim` features of each head
    only; the rest pass unrotated, as transformers' Phi-3 applies them."""

    cos: Tensor
    sin: Tensor
    sign: Tensor
    on: bool = True

    @classmethod
    def of(cls, cos: Tensor, sin: Tensor, on: bool = True) -> Rope:
        """From transformers' (B, T, hd) tables; `on`: whether the layer rotates Q and K at all."""
        sign = cos.new_ones(cos.shape[-1])
        sign[: cos.shape[-1] // 2] = -1
        return cls(cos.unsqueeze(1), sin.unsqueeze(1), sign, on)

    @property
    def rotary_dim(self) -> int:
        """Features of each head that RoPE turns (the head dimension, or less with partial rotary)."""
        return self.cos.shape[-1]

    def chunk(self, start: int, end: int) -> Rope:
        """The tables of positions start..end."""
        return Rope(self.cos[:, :, start:end], self.sin[:, :, start:end], self.sign, self.on)


def rotate_half(t: Tensor, rope: Rope) -> Tensor:
    """transformers' rotate_half of t (..., hd)."""
    return torch.roll(t, t.shape[-1] // 2, -1).mul_(rope.sign)


def rotate(t: Tensor, rope: Rope) -> Tensor:
    """RoPE as transformers applies it: t * cos + rotate_half(t) * sin (heads on dim 1); t in a layer
    without RoPE; with partial rotary, that of the first `rotary_dim` features, the rest unchanged."""
    if not rope.on:
        return t
    if rope.rotary_dim < t.shape[-1]:
        turned, passed = t[..., : rope.rotary_dim], t[..., rope.rotary_dim :]
        return torch.cat([turned * rope.cos + rotate_half(turned, rope) * rope.sin, passed], dim=-1)
    return t * rope.cos + rotate_half(t, rope) * rope.sin


def rope_transpose(grad: Tensor, rope: Rope) -> Tensor:
    """dL/dk of rotated = k * cos + rotate_half(k) * sin (heads on dim 1); grad in a layer without RoPE;
    with partial rotary, the first `rotary_dim` features' transpose, the rest's gradient unchanged."""
    if not rope.on:
        return grad
    if rope.rotary_dim < grad.shape[-1]:
        turned, passed = grad[..., : rope.rotary_dim], grad[..., rope.rotary_dim :]
        return torch.cat([turned * rope.cos - rotate_half(turned * rope.sin, rope), passed], dim=-1)
    return grad * rope.cos - rotate_half(grad * rope.sin, rope)
