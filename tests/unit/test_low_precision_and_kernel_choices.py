"""Every family in bfloat16 and float16, and under every `--attn` choice, runs every method: verify on CPU
within the low-precision criterion (each method's error against a float32 reference at most 2x plain's in
the same precision), and a short simulated step of each method. A few families run by default (in low
precision the float32 RoPE tables of OLMo 3 and DeepSeek-V3's narrower values; under each kernel choice the
eager-only attention of Gemma 2 and gpt-oss), every family with `-m slow`."""

from __future__ import annotations

import pytest

from streambp_core.config import ATTN_BACKENDS, VERIFY_METHODS, StepSpec
from streambp_core.models.families import TINY_FAMILIES
from streambp_core.step.simulation.simulate import simulate
from streambp_core.verify.methods import LOW_PRECISION_FACTOR, VerifySpec, verify_spec

LOW_PRECISION_DEFAULT = ("olmo3", "deepseek-v3")
"""The families that verify in low precision without `-m slow`."""
KERNEL_CHOICE_DEFAULT = ("gemma2", "gpt-oss")
"""The families that run each kernel choice without `-m slow`."""
SHORT = {"seq_len_tokens": 40, "partition_size": 16, "head_partition_size": 8}
"""A step long enough for three chunks and past the tiny presets' 16-token sliding windows."""


def families(default: tuple[str, ...]) -> list:
    """Every tiny family, all but those of `default` slow."""
    return [pytest.param(name, marks=() if name in default else pytest.mark.slow) for name in TINY_FAMILIES]


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("family", families(LOW_PRECISION_DEFAULT))
def test_every_method_verifies_in_low_precision(family, dtype):
    report = verify_spec(VerifySpec.of(model=f"tiny/{family}", dtype=dtype, **SHORT))
    assert report.reference_dtype == "float32"
    assert [result.method for result in report.results] == list(VERIFY_METHODS)
    for result in report.results:
        assert result.baseline_rel_err is not None and result.baseline_rel_err > 0
        assert result.tolerance >= LOW_PRECISION_FACTOR * result.baseline_rel_err
    assert report.ok, [(r.method, r.max_rel_err, r.tolerance, r.loss_abs_err) for r in report.results]


@pytest.mark.parametrize("attn", ATTN_BACKENDS)
@pytest.mark.parametrize("family", families(KERNEL_CHOICE_DEFAULT))
def test_every_kernel_choice_verifies_exactly(family, attn):
    """The baselines attend through the engine attention registered under `attn` (transformers' checks
    included), streambp through the engine's own: every method exact in float64."""
    report = verify_spec(VerifySpec.of(model=f"tiny/{family}", dtype="float64", attn=attn, **SHORT))
    assert report.ok, [(r.method, r.max_rel_err) for r in report.results]
    assert all(result.max_rel_err <= 1e-12 for result in report.results)


@pytest.mark.parametrize("attn", ATTN_BACKENDS)
@pytest.mark.parametrize("family", families(KERNEL_CHOICE_DEFAULT))
def test_every_kernel_choice_simulates(family, attn):
    """Each method's simulated step at a short length, as max-len probes it, under each `attn`."""
    for method in VERIFY_METHODS:
        spec = StepSpec.of(model=f"tiny/{family}", method=method, dtype="bfloat16", attn=attn,
                           seq_len_tokens=256, partition_size=64, head_partition_size=32)
        result = simulate(spec)
        assert result.peak_bytes > 0 and min(result.breakdown_bytes.values()) >= 0, (method, result)
