"""Gradient distance: relative per parameter, absolute where the reference is zero, NaN is worst."""

from __future__ import annotations

import math

import pytest
import torch

from streambp_core.verify import compare
from streambp_core.verify.compare import max_rel_err, rel_err


def test_relative_error_of_a_scaled_gradient():
    ref = torch.tensor([3.0, 4.0])
    assert rel_err(ref * 1.5, ref) == pytest.approx(0.5)


def test_zero_reference_uses_the_absolute_norm():
    assert rel_err(torch.tensor([3.0, 4.0]), torch.zeros(2)) == pytest.approx(5.0)
    assert rel_err(torch.tensor([3.0, 4.0]), None) == pytest.approx(5.0)
    assert rel_err(None, torch.tensor([3.0, 4.0])) == pytest.approx(1.0)
    assert rel_err(None, None) == 0.0


def test_norms_are_float64_and_sliced(monkeypatch):
    monkeypatch.setattr(compare, "NORM_SLICE_ELEMENTS", 3)
    ref = torch.arange(1.0, 11.0, dtype=torch.float32)
    grad = ref + 1e-3
    expected = math.sqrt(10 * 1e-6) / float(torch.linalg.vector_norm(ref.double()))
    assert rel_err(grad, ref) == pytest.approx(expected, rel=1e-3)


def test_max_rel_err_names_the_worst_parameter_and_nan_wins():
    ref = {"a": torch.ones(2), "b": torch.ones(2), "c": torch.ones(2)}
    grads = {"a": torch.ones(2), "b": torch.ones(2) * 3, "c": torch.ones(2) * 2}
    assert max_rel_err(grads, ref) == (pytest.approx(2.0), "b")
    grads["a"] = torch.tensor([float("nan"), 1.0])
    err, worst = max_rel_err(grads, ref)
    assert math.isnan(err) and worst == "a"


def test_different_parameter_sets_are_an_error():
    with pytest.raises(ValueError):
        max_rel_err({"a": torch.ones(1)}, {"b": torch.ones(1)})


def test_max_grad_err_judges_a_rounding_zero_gradient_against_the_models_gradient_scale():
    ref = {"big": torch.full((100,), 1.0), "zero": torch.full((100,), 1e-9)}
    grads = {"big": ref["big"].clone(), "zero": torch.full((100,), -1e-9)}
    assert max_rel_err(grads, ref)[0] == pytest.approx(2.0)  # noise over noise
    err, worst = compare.max_grad_err(grads, ref)
    rms = math.sqrt((100 * 1.0 + 100 * 1e-18) / 200)
    assert worst == "zero"
    assert err == pytest.approx(2e-9 * 10 / (1e-9 * 10 + 10 * rms), rel=1e-6)
    assert err < 1e-8


def test_max_grad_err_still_sees_a_wrong_gradient_and_nan():
    ref = {"a": torch.ones(4), "b": torch.ones(4)}
    assert compare.max_grad_err({"a": torch.ones(4), "b": torch.ones(4) * 1.5}, ref) == (
        pytest.approx(0.5 * 2 / (2 + 2)), "b")
    err, worst = compare.max_grad_err({"a": torch.ones(4), "b": torch.tensor([float("nan")] * 4)}, ref)
    assert math.isnan(err) and worst == "b"


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_comparing_leaves_the_gradients_as_they_were(dtype):
    """A float64 gradient's `.double()` is the tensor itself: comparing must not write the difference into
    it, so a second comparison of the same gradients (or the step using them) sees the true values."""
    grads = {"w": torch.ones(4, dtype=dtype), "b": torch.full((3,), 2.0, dtype=dtype)}
    reference = {"w": 0.5 * torch.ones(4, dtype=torch.float64),
                 "b": torch.full((3,), 2.0, dtype=torch.float64)}
    before = {name: grad.clone() for name, grad in grads.items()}
    first = max_rel_err(grads, reference)
    compare.max_grad_err(grads, reference)
    assert max_rel_err(grads, reference) == first == (pytest.approx(1.0), "w")
    assert all(torch.equal(grads[name], before[name]) for name in grads)
