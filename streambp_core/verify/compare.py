"""Distance between two sets of parameter gradients, computed in float64 without full float64 copies.

`max_rel_err` is the plain relative error ||g - g_ref|| / ||g_ref|| of the worst parameter. `max_grad_err`
is the criterion `verify` judges by, relative and absolute like `torch.testing.assert_close`
(|g - g_ref| <= atol + rtol |g_ref|), in norms: per parameter p with n_p elements,

    err_p = ||g_p - g_ref,p|| / (||g_ref,p|| + sqrt(n_p) * rms),   rms = RMS of g_ref over all parameters,

so err_p <= rtol means ||g_p - g_ref,p|| <= rtol ||g_ref,p|| + atol sqrt(n_p) with atol = rtol * rms. A
gradient that is zero up to rounding (e.g. the query projection's at 2 tokens, where each query sees one
key) is judged against the model's gradient scale rather than against its own rounding noise.
"""

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
    if grad is None and ref is None:
        return 0.0, 0.0
    if grad is None or ref is None:
        present = ref if grad is None else grad
        norm_sq = float(torch.linalg.vector_norm(present.detach(), dtype=torch.float64)) ** 2
        return norm_sq, (0.0 if ref is None else norm_sq)
    diff_sq = ref_sq = 0.0
    for start in range(0, ref.numel(), NORM_SLICE_ELEMENTS):
        ref_slice = _slice(ref, start)
        diff64 = _slice(grad, start).double() - ref_slice  # out of place: float64 `.double()` is no copy
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
    _same_names(grads, reference)
    return _worst({name: rel_err(grads[name], ref) for name, ref in reference.items()})


def max_grad_err(grads: Gradients, reference: Gradients) -> tuple[float, str]:
    """Largest per-parameter error relative to ||g_ref|| + sqrt(numel) * RMS of g_ref over all parameters
    (module docstring; NaN beats everything) and the parameter's name."""
    _same_names(grads, reference)
    norms = {name: _squared_norms(grads[name], ref) for name, ref in reference.items()}
    sizes = {name: _numel(grads[name], ref) for name, ref in reference.items()}
    total_elements = sum(sizes.values())
    rms = math.sqrt(sum(ref_sq for _, ref_sq in norms.values()) / total_elements) if total_elements else 0.0
    errors = {}
    for name, (diff_sq, ref_sq) in norms.items():
        scale = math.sqrt(ref_sq) + math.sqrt(sizes[name]) * rms
        errors[name] = math.sqrt(diff_sq) / scale if scale > 0 else math.sqrt(diff_sq)
    return _worst(errors)


def _numel(grad: torch.Tensor | None, ref: torch.Tensor | None) -> int:
    present = ref if ref is not None else grad
    return 0 if present is None else present.numel()


def _same_names(grads: Gradients, reference: Gradients) -> None:
    if set(grads) != set(reference):
        raise ValueError("gradient sets name different parameters")


def _worst(errors: dict[str, float]) -> tuple[float, str]:
    worst = max(errors, key=lambda name: math.inf if math.isnan(errors[name]) else errors[name])
    return errors[worst], worst
