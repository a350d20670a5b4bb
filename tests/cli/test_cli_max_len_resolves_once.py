"""A max-len run resolves its model's config once: model builds trust it, and the only copies are the
config at the depths the simulation runs (`step.parts.resolved.ResolvedModel`)."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
from transformers import PretrainedConfig
from typer.testing import CliRunner

import streambp_core.models.load as load
from streambp_bench.cli import app
from streambp_core.models import tiny_config


@pytest.mark.slow
def test_a_max_len_run_validates_the_config_once_and_copies_it_per_depth_only(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    tiny_config("qwen3", num_hidden_layers=6).save_pretrained(tmp_path)  # deep enough to extrapolate
    counts = {"validations": 0, "copies": 0}
    check_supported, deepcopy = load.check_supported, copy.deepcopy

    def counted_check(*args, **kwargs):
        counts["validations"] += 1
        return check_supported(*args, **kwargs)

    def counted_deepcopy(value, memo=None):
        counts["copies"] += isinstance(value, PretrainedConfig) and memo is None
        return deepcopy(value, memo)

    monkeypatch.setattr(load, "check_supported", counted_check)
    monkeypatch.setattr(copy, "deepcopy", counted_deepcopy)
    result = CliRunner().invoke(app, ["max-len", "-m", str(tmp_path), "--budget-gib", "0.05", "--ps", "64",
                                      "--ps-head", "32", "--jobs", "1", "--json"])
    assert result.exit_code == 0, result.output
    found = {r["method"]: r["max_len_tokens"] for r in json.loads(result.stdout)["results"]}
    assert set(found) == {"plain", "checkpoint", "mst", "streambp"} and all(n > 0 for n in found.values())
    assert counts["validations"] == 1  # the plan's ResolvedModel; every build of the four searches trusts it
    assert counts["copies"] == 2  # the config at 2 and at 3 layers (6 layers is the config itself)
