"""verify_methods: passes exact methods, catches a wrong one, applies the bf16 rule, validates input."""

from __future__ import annotations

import pytest

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.verify.methods import VerifySpec, verify_methods

SMALL = {"seq_len": 19, "partition_size": 6, "head_partition_size": 4}


@pytest.mark.parametrize("model", ["tiny/qwen3", "tiny/qwen2", "tiny/llama", "tiny/mistral"])
def test_every_method_matches_plain_in_float64_with_padding(model):
    report = verify_methods(model, dtype="float64", padding="left", batch_size=2, **SMALL)
    assert report.ok, report
    assert [result.method for result in report.results] == ["checkpoint", "mst", "streambp"]
    assert all(result.max_rel_err <= 1e-10 for result in report.results)


def test_a_method_with_wrong_gradients_fails(monkeypatch):
    real_prepare = streambp_core.prepare

    class ScaledLoss:
        """Wraps a run so its loss (and so every gradient) is 0.1% too large."""

        def __init__(self, run):
            self.run = run

        def loss(self, *args, **kwargs):
            return self.run.loss(*args, **kwargs) * 1.001

        def __enter__(self):
            return self

        def __exit__(self, *exc_info):
            self.run.close()

    def prepare(model, method, config=None, **options):
        run = real_prepare(model, method, config, **options)
        return ScaledLoss(run) if method == "streambp" else run

    monkeypatch.setattr(streambp_core, "prepare", prepare)
    report = verify_methods("tiny/llama", dtype="float64", methods=("checkpoint", "streambp"), **SMALL)
    verdicts = {result.method: result for result in report.results}
    assert verdicts["checkpoint"].ok and not verdicts["streambp"].ok
    assert 5e-4 < verdicts["streambp"].max_rel_err < 1e-3  # 1e-3 relative, over norm + atol (CRITERION)
    assert not report.ok


def test_bfloat16_is_judged_against_an_fp32_reference_relative_to_plain_bf16():
    report = verify_methods("tiny/llama", dtype="bfloat16", methods=("plain", "streambp"), **SMALL)
    assert report.reference_dtype == "float32"
    plain, streambp = report.results
    assert plain.max_rel_err == pytest.approx(plain.baseline_rel_err)
    assert 0 < plain.baseline_rel_err < 0.1
    assert streambp.tolerance == pytest.approx(2 * plain.baseline_rel_err + 1e-6)
    assert report.ok


def test_json_summary_has_the_documented_keys():
    summary = verify_methods("tiny/qwen3", methods=("streambp",), **SMALL).to_dict()
    assert (summary["reference"], summary["dtype"], summary["source"]) == ("plain", "float32", "measured-cpu")
    assert set(summary["results"][0]) >= {"method", "max_rel_err", "loss_abs_err", "ok", "worst_param"}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("seq_len_tokens", 1),
        ("batch_size", 0),
        ("partition_size", 0),
        ("head_partition_size", -3),
        ("dtype", "float8"),
        ("padding", "middle"),
        ("methods", ("sgd",)),
        ("methods", ()),
        ("device", "tpu"),
    ],
)
def test_bad_spec_is_a_config_error(field, value):
    with pytest.raises(ConfigError):
        VerifySpec.of(model="tiny/qwen3", **{field: value})
