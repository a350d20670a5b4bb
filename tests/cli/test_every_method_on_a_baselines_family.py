"""Every method asked of a family of the baselines tier (`--method all`): the methods its family runs answer
(streambp through its own layers, simulated too) and the others are named with the reason (mst where its
pieces do not apply), in max-len, sweep and verify alike; a method named alone is still refused by name."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.commands.sweep import _without_refused
from streambp_bench.commands.verify.grads import without_refused
from streambp_bench.maxlen.plan import runnable
from streambp_core.config import METHODS, VERIFY_METHODS, ConfigError, StepSpec
from streambp_core.methods.guards import family_refusals
from streambp_core.models.load import load_config
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.verify.methods import VerifySpec

TINY = {
    "gpt2": {"n_embd": 64, "n_layer": 2, "n_head": 4, "vocab_size": 512, "n_positions": 512},
    "cohere": {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
               "intermediate_size": 128, "vocab_size": 512, "pad_token_id": 0, "bos_token_id": 1,
               "eos_token_id": 2},
}
"""Tiny configs of a baselines family mst runs (gpt2) and of one it refuses (cohere: logits scaled)."""


def model_dir(tmp_path: Path, model_type: str) -> str:
    directory = tmp_path / model_type
    directory.mkdir()
    (directory / "config.json").write_text(json.dumps({"model_type": model_type, **TINY[model_type]}))
    return str(directory)


def test_family_refusals_name_mst_where_its_pieces_do_not_apply(tmp_path):
    gpt2 = load_config(model_dir(tmp_path, "gpt2"))
    assert family_refusals(gpt2) == {}  # streambp runs (and simulates) through its own layers
    cohere = load_config(model_dir(tmp_path, "cohere"))
    assert set(family_refusals(cohere)) == {"mst"}
    (mst,) = family_refusals(cohere).values()
    assert mst.startswith("mst: architecture 'cohere' changes the logits after its lm_head")
    assert family_refusals(load_config("tiny/qwen3")) == {}


def test_max_len_plan_leaves_out_what_the_family_refuses_only_for_every_method(tmp_path):
    directory = model_dir(tmp_path, "cohere")
    specs = tuple(StepSpec.of(model=directory, method=method) for method in METHODS)
    resolved = ResolvedModel(directory)
    kept, refused = runnable(specs, resolved, every_method=True)
    assert [spec.method for spec in kept] == ["plain", "checkpoint", "streambp"]
    assert [method for method, _ in refused] == ["mst"]
    assert refused[0][1].startswith("architecture 'cohere' changes the logits after its lm_head")
    with pytest.raises(ConfigError, match="^mst: architecture 'cohere' changes the logits"):
        runnable(specs, resolved, every_method=False)


def test_verify_and_sweep_leave_out_the_same_methods(tmp_path):
    directory = model_dir(tmp_path, "gpt2")
    spec, refused = without_refused(VerifySpec.of(model=directory, methods=VERIFY_METHODS, device="cpu"),
                                    every_method=True)
    assert spec.methods == VERIFY_METHODS and refused == ()  # verify runs streambp through its own layers
    named, none = without_refused(spec.__class__.of(model=directory, methods=("streambp",), device="cpu"),
                                  every_method=False)
    assert named.methods == ("streambp",) and none == ()
    points = tuple(StepSpec.of(model=directory, method=method, seq_len_tokens=length)
                   for method in METHODS for length in (64, 128))
    kept, left_out = _without_refused(points, {directory: load_config(directory)})
    assert kept == points and left_out == ()  # streambp simulates through its own layers


@pytest.mark.slow
def test_max_len_every_method_on_a_baselines_family_answers_and_names_the_refused(tmp_path):
    directory = model_dir(tmp_path, "cohere")
    command = ["max-len", "-m", directory, "--budget-gib", "0.05", "--jobs", "1"]
    result = CliRunner().invoke(app, [*command, "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert [row["method"] for row in document["results"]] == ["plain", "checkpoint", "streambp"]
    assert all(row["max_len_tokens"] > 0 for row in document["results"])
    assert [row["method"] for row in document["refused"]] == ["mst"]
    alone = CliRunner().invoke(app, [*command, "--method", "mst"])
    assert alone.exit_code == 2
    assert "mst: architecture 'cohere' changes the logits after its lm_head" in alone.output
