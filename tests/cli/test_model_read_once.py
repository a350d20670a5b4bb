"""A model's name is matched to a preset and its config.json read in one place (`models.catalogue`), and a
command reads it once per resolution: `max-len --packing --gpu-model` reads it for the cheap checks before
torch is imported and once for the search, whose resolved model the packing notes reuse."""

from __future__ import annotations

import json
from collections import Counter

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_core.models import catalogue, load_config, tiny_config
from streambp_core.step.parts.resolved import ResolvedModel

STEP = ["-m", "tiny/qwen3", "--method", "streambp", "--dtype", "float32", "--budget-gib", "0.0025",
        "--ps", "64", "--ps-head", "64"]


@pytest.fixture
def reads(monkeypatch: pytest.MonkeyPatch) -> Counter:
    """The config.json files read, by name, while the test runs."""
    counted: Counter = Counter()
    read = catalogue.read_config_file

    def counting(path):
        counted[path.name] += 1
        return read(path)

    monkeypatch.setattr(catalogue, "read_config_file", counting)
    return counted


def test_a_resolution_reads_the_config_once(reads: Counter) -> None:
    ResolvedModel(" TINY/Qwen3 ")  # a preset's name, any case, spaces around it
    assert reads == Counter({"tiny--qwen3.json": 1})
    load_config("tiny/llama")
    tiny_config("llama", num_key_value_heads=1)
    assert reads["tiny--llama.json"] == 2


def test_max_len_with_packing_and_a_gpu_model_resolves_the_model_once(reads: Counter) -> None:
    result = CliRunner().invoke(app, ["max-len", *STEP, "--packing", "3", "--gpu-model", "h100", "--json"])
    assert result.exit_code == 0, result.output
    assert json.loads(result.stdout)["packing"], "the packing notes ran"
    assert reads == Counter({"tiny--qwen3.json": 2}), "the cheap check before torch, then the search's"


def test_an_unknown_name_is_refused_by_the_catalogue_listing_the_presets(tmp_path) -> None:
    with pytest.raises(catalogue.ConfigError, match="unknown model 'no/such': not a preset nor a local"):
        catalogue.model_file("no/such")
    with pytest.raises(catalogue.ConfigError, match="has no config.json"):
        catalogue.model_file(str(tmp_path))
    assert catalogue.find_preset(" tiny/LLAMA") == "tiny/llama" and catalogue.find_preset("llama") is None
