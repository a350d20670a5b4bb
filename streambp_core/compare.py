"""Distance between two sets of parameter gradients, computed in float64 without full float64 copies."""

from __future__ import annotations

import math

import torch

Gradients = dict[str, torch.Tensor | None]
"""Parameter name -> gradient (None where the parameter got none)."""

NORM_SLICE_ELEMENTS = 1 << 22
"""Elements per float64 slice when computing gradient norms (32 MiB of float64)."""


def _slice(tensor: torch.Tensor, start: int) -> torch.Tensor:
    return tensor.detach().reshape(-1)[start : start + NORM_SLICE_ELEMENTS]


def _squared_norms(grad: torch.Tensor | None, ref: torch.Tensor | None) -> tuple[float, float]:
    """(||grad - ref||^2, ||ref||^2) in float64, a slice at a time so no full float64 copy exists."""
    if grad is None or ref is None:
        present = ref if grad is None else grad
        norm_sq = float(torch.linalg.vector_norm(present.detach(), dtype=torch.float64)) ** 2
        return norm_sq, (0.0 if ref is None else norm_sq)
    diff_sq = ref_sq = 0.0
    for start in range(0, ref.numel(), NORM_SLICE_ELEMENTS):
        ref_slice = _slice(ref, start)
        diff64 = _slice(grad, start).double().sub_(ref_slice)
        diff_sq += float(torch.linalg.vector_norm(diff64)) ** 2
        ref_sq += float(torch.linalg.vector_norm(ref_slice, dtype=torch.float64)) ** 2
    return diff_sq, ref_sq


def rel_err(grad: torch.Tensor | None, ref: torch.Tensor | None) -> float:
    """||grad - ref|| / ||ref|| in float64, or ||grad - ref|| when ||ref|| = 0. None counts as zeros."""
    if grad is None and ref is None:
        return 0.0
    diff_sq, ref_sq = _squared_norms(grad, ref)
    return math.sqrt(diff_sq / ref_sq) if ref_sq > 0 else math.sqrt(diff_sq)


def max_rel_err(grads: Gradients, reference: Gradients) -> tuple[float, str]:
    """Largest per-parameter relative gradient error (NaN beats everything) and the parameter's name."""
    if set(grads) != set(reference):
        raise ValueError("gradient sets name different parameters")
    errors = {name: rel_err(grads[name], ref) for name, ref in reference.items()}
    worst = max(errors, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
    return errors[worst], worst
