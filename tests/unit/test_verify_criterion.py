"""verify's verdicts: no false FAIL on gradients that are zero up to rounding, float64 throughout, the
criterion stated, and a model too big for the RAM refused before it is built."""

from __future__ import annotations

import pytest

from streambp_core.config import ConfigError
from streambp_core.measure import host_ram
from streambp_core.models import load_config
from streambp_core.verify import ram as verify_ram
from streambp_core.verify.methods import CRITERION, VerifySpec, verify_methods, verify_spec


@pytest.mark.parametrize("seq_len", [2, 3])
def test_two_or_three_tokens_pass_in_float32(seq_len):
    report = verify_methods("tiny/qwen3", seq_len=seq_len, partition_size=1, head_partition_size=1)
    assert report.ok, report.results
    assert all(result.max_rel_err < 1e-5 for result in report.results)


def test_float64_loss_is_judged_at_1e10_against_a_float64_reference():
    report = verify_methods("tiny/llama", dtype="float64", seq_len=17, partition_size=5,
                            head_partition_size=3)
    assert report.ok
    for result in report.results:
        assert result.loss_tolerance == pytest.approx(1e-10 * max(1.0, abs(report.reference_loss)))
        assert result.loss_abs_err <= 1e-13
        assert result.max_rel_err <= 1e-13


def test_the_report_states_its_criterion():
    summary = verify_methods("tiny/qwen3", methods=("streambp",), seq_len=8).to_dict()
    assert summary["criterion"] == CRITERION
    assert "rtol" in CRITERION and "rms" in CRITERION


def test_a_model_too_big_for_the_ram_is_refused_before_it_is_built(monkeypatch):
    spec = VerifySpec.of(model="Qwen/Qwen3-32B")
    with pytest.raises(ConfigError, match=r"needs at least 36\d\.\d GiB of RAM.*16\.0 GiB available"):
        verify_ram.check_ram(load_config(spec.step.model), spec, spec_dtype(), available_bytes=16 * 2**30)
    monkeypatch.setattr(host_ram, "available_ram_bytes", lambda: 16 * 2**30)
    with pytest.raises(ConfigError, match="needs at least"):
        verify_spec(spec)


def test_a_small_model_fits():
    spec = VerifySpec.of(model="tiny/qwen3")
    verify_ram.check_ram(load_config(spec.step.model), spec, spec_dtype(), available_bytes=2**30)


def spec_dtype():
    import torch

    return torch.float32
