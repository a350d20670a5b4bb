"""`streambp-bench max-len` through Typer's CliRunner on the tiny preset with a small budget."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from streambp_core.step.parts import target as target_module
from tests.cli.errors import one_line_error

TINY = ["max-len", "--model", "tiny/qwen3", "--ps", "32", "--ps-head", "16", "--budget-gib", "0.003"]
SIM = [*TINY, "--device", "sim"]



def test_json_reports_every_method_with_its_breakdown(runner):
    result = runner.invoke(app, [*SIM, "--json"])
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["model"] == "tiny/qwen3" and doc["source"] == "simulated"
    assert doc["budget_gib"] == pytest.approx(0.003)
    by_method = {r["method"]: r for r in doc["results"]}
    assert list(by_method) == ["plain", "checkpoint", "mst", "streambp"]
    for entry in by_method.values():
        lo, hi = entry["bracket_tokens"]
        assert entry["max_len_tokens"] == lo > 0 and hi - lo <= max(128, lo // 100 + 1)
        assert entry["peak_gib"] <= 0.003
        assert sum(entry["breakdown_gib"].values()) == pytest.approx(entry["peak_gib"])
    assert by_method["streambp"]["max_len_tokens"] > by_method["checkpoint"]["max_len_tokens"]
    assert by_method["checkpoint"]["ratio_to_checkpoint"] == 1.0


def test_table_says_how_numbers_were_obtained(runner, stub_probe):
    result = runner.invoke(app, [*SIM, "--method", "checkpoint,streambp"])
    assert result.exit_code == 0, result.output
    assert {spec.method for spec in stub_probe.specs} == {"checkpoint", "streambp"}
    for text in (
        "max trainable length",
        "simulated",
        "x ckpt",
        "checkpoints",
        "max(1%, 128 tokens)",
        "meta tensors",
        "streambp",
    ):
        assert text in result.stdout
    assert "plain" not in result.stdout.split("memory at that peak")[0]


@pytest.mark.parametrize("attn", ["sdpa", pytest.param("flash", marks=pytest.mark.slow)])
def test_an_eager_only_soft_capped_family_searches_under_each_kernel_choice(runner, attn):
    """Gemma 2 (no SDPA in transformers, soft-capped scores) under --attn sdpa and flash: no traceback, and
    the table says which kernel its capped attention is charged as."""
    args = ["max-len", "--model", "tiny/gemma2", "--ps", "32", "--ps-head", "16", "--budget-gib", "0.003",
            "--device", "sim", "--method", "checkpoint,streambp", "--attn", attn]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    words = " ".join(result.stdout.split())
    assert "Soft-capped attention" in words
    assert ("flash-attn >= 2.6's buffers" if attn == "flash" else "score-sized buffers") in words


def test_out_upserts_one_max_len_row_per_method(runner, tmp_path, stub_probe):
    path = tmp_path / "maxlen.csv"
    for methods in ("plain,streambp", "plain"):  # the rerun of plain replaces its row
        result = runner.invoke(app, [*SIM, "--method", methods, "--out", str(path)])
        assert result.exit_code == 0, result.output
    assert [spec.method for spec in stub_probe.specs] == ["streambp", "plain", "plain"]  # the costliest first
    rows = ResultsFile(path).rows()
    assert [(r.method, r.metric, r.source) for r in rows] == [
        ("plain", "max_len", "simulated"),
        ("streambp", "max_len", "simulated"),
    ]
    assert rows[1].value > rows[0].value > 0
    assert rows[1].partition_size == 32 and rows[0].partition_size is None


@pytest.mark.slow
def test_out_rows_of_another_protocol_grads_attn_or_optimizer_are_other_points(runner, tmp_path):
    path = tmp_path / "maxlen.csv"
    variants = [[], ["--protocol", "paper"], ["--grads", "fresh"], ["--attn", "sdpa"]]
    variants += [["--optimizer", "adamw"]]
    for extra in (*variants, []):  # the last run replaces the first one's row
        result = runner.invoke(app, [*SIM, "--method", "plain", "--out", str(path), *extra])
        assert result.exit_code == 0, result.output
    rows = ResultsFile(path).rows()
    assert [(r.protocol, r.grads, r.attn, r.optimizer) for r in rows] == [
        ("default", "resident", "auto", "none"),
        ("paper", "resident", "auto", "none"),
        ("default", "fresh", "auto", "none"),
        ("default", "resident", "sdpa", "none"),
        ("default", "fresh", "auto", "adamw"),  # a training step with an optimizer makes its gradients
    ]
    assert rows[1].value < rows[0].value  # the paper's protocol holds the logits through backward


@pytest.mark.slow
def test_cpu_measures_real_tensors_near_the_simulated_bracket(runner):
    args = ["max-len", "-m", "tiny/qwen3", "--device", "cpu", "--method", "streambp"]
    args += ["--dtype", "float32", "--ps", "128", "--ps-head", "64", "--budget-gib", "0.003", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    doc = json.loads(result.stdout)
    assert doc["source"] == "measured-cpu"
    for entry in doc["results"]:
        assert entry["max_len_tokens"] > 0 and entry["peak_gib"] <= 0.003
        assert entry["probes_by_source"]["measured-cpu"] <= 4  # aimed at the simulated bracket first


def test_help_has_examples(runner):
    result = runner.invoke(app, ["max-len", "--help"])
    assert result.exit_code == 0
    assert "Examples" in result.output and "streambp-bench max-len" in result.output


@pytest.mark.parametrize(("model", "budget_gib", "held"), [
    ("Qwen/Qwen3-8B", "24", "30.51 GiB in bfloat16"),
    ("tiny/qwen3", "0.0001", "holds (weights, grads, optimizer state: 0.5 MiB in bfloat16)")])
def test_budget_below_weights_and_grads_gives_the_figure(runner, model, budget_gib, held):
    """Other bad input to max-len: tests/cli/test_cli_bad_input.py."""
    result = runner.invoke(app, ["max-len", "--model", model, "--budget-gib", budget_gib, "--device", "sim"])
    assert held in one_line_error(result)


def test_cuda_without_a_gpu_is_one_line(runner, monkeypatch):
    monkeypatch.setattr(target_module, "cuda_available", lambda: False)
    result = runner.invoke(app, [*TINY, "--device", "cuda"])
    assert "no CUDA device" in one_line_error(result)


@pytest.mark.slow
def test_training_step_options_search_a_full_step(runner):
    """--objective/--lora-rank/--optimizer: a GRPO group with AdamW costs more than backprop alone."""
    base = [*SIM, "--method", "checkpoint,streambp", "--budget-gib", "0.02", "--json"]
    plain_bp = json.loads(runner.invoke(app, base).stdout)
    training = runner.invoke(app, [*base, "--objective", "grpo", "--batch-size", "4", "--optimizer", "adamw"])
    assert training.exit_code == 0, training.output
    full = json.loads(training.stdout)
    for before, after in zip(plain_bp["results"], full["results"], strict=True):
        assert 0 < after["max_len_tokens"] < before["max_len_tokens"]
        assert after["breakdown_gib"]["optimizer"] > 0
    lora = json.loads(runner.invoke(app, [*base, "--lora-rank", "4", "--optimizer", "adamw"]).stdout)
    assert all(r["breakdown_gib"]["grads"] < 0.001 for r in lora["results"])  # adapters only


@pytest.mark.parametrize(
    ("args", "expected"),
    [
        (["--lora-rank", "-1"], "lora rank"),
        (["--optimizer", "sgd"], "Invalid value for '--optimizer'"),
        (["--objective", "grpo", "--device", "cpu"], "simulated only"),
        (["--optimizer", "adamw", "--protocol", "paper"], "sizes the paper's backprop-only step"),
        (["--optimizer", "adamw", "--grads", "resident"], "grads resident with an optimizer"),
    ],
)
def test_bad_training_options(runner, args, expected):
    result = runner.invoke(app, [*TINY, *([] if "--device" in args else ["--device", "sim"]), *args])
    assert expected in one_line_error(result)


def test_the_report_ends_with_the_trainer_call_for_the_longest_length(runner, stub_probe):
    result = runner.invoke(app, [*SIM, "--method", "checkpoint,streambp"])
    assert result.exit_code == 0, result.output
    line = next(line for line in result.stdout.splitlines() if line.startswith("Train at "))
    assert '(streambp)' in line and 'stream_trainer(trainer, "streambp", partition_size=32' in line


@pytest.mark.parametrize(("args", "expected"), [
    (["--shard", "zero2"], "--shard needs --gpus"),
    (["--gpus", "2", "--shard", "zero2", "--device", "cpu"], "does not apply to --device cpu"),
    (["--gpus", "4"], "gpus 4 needs a shard stage"),
    (["--gpus", "0", "--shard", "zero3"], "gpus must be a positive integer"),
])
def test_sharding_bad_input_is_one_line(runner, args, expected):
    assert expected in one_line_error(runner.invoke(app, [*TINY, *args]))


def test_gpus_and_shard_reach_the_searched_step_and_are_key_columns(runner, tmp_path, stub_probe):
    out = tmp_path / "r.csv"
    args = [*TINY, "--method", "checkpoint", "--optimizer", "adamw", "--budget-gib", "0.006",
            "--out", str(out)]
    for extra in ([], ["--gpus", "4", "--shard", "zero3"]):
        result = runner.invoke(app, [*args, *extra, "--json"])
        assert result.exit_code == 0, result.output
    assert [(spec.gpus, spec.shard) for spec in stub_probe.specs] == [(1, "none"), (4, "zero3")]
    assert {(row.gpus, row.shard) for row in ResultsFile(out).rows()} == {(1, "none"), (4, "zero3")}


@pytest.mark.slow
def test_gpus_and_shard_search_one_rank_and_are_key_columns(runner, tmp_path):
    out = tmp_path / "r.csv"
    args = [*TINY, "--method", "checkpoint", "--optimizer", "adamw", "--budget-gib", "0.006",
            "--out", str(out)]
    single = runner.invoke(app, [*args, "--json"])
    sharded = runner.invoke(app, [*args, "--gpus", "4", "--shard", "zero3", "--json"])
    assert single.exit_code == 0 and sharded.exit_code == 0, sharded.output
    one, four = (json.loads(r.stdout)["results"][0] for r in (single, sharded))
    assert four["max_len_tokens"] > one["max_len_tokens"]
    rows = {(row.gpus, row.shard): row for row in ResultsFile(out).rows()}
    assert set(rows) == {(1, "none"), (4, "zero3")}
    assert rows[4, "zero3"].optimizer_gib < rows[1, "none"].optimizer_gib


@pytest.mark.slow
def test_worker_processes_give_the_same_answers_as_one_process(runner):
    """--jobs 2 runs the searches on two workers forked from a fork server; each search is the same, probe
    for probe, so the report is the same to the byte."""
    serial = runner.invoke(app, [*SIM, "--json", "--jobs", "1"])
    parallel = runner.invoke(app, [*SIM, "--json", "--jobs", "2"])
    assert serial.exit_code == 0 and parallel.exit_code == 0, parallel.output
    assert json.loads(parallel.stdout) == json.loads(serial.stdout)
    assert [r["method"] for r in json.loads(parallel.stdout)["results"]] == ["plain", "checkpoint", "mst",
                                                                             "streambp"]


@pytest.mark.slow
def test_the_entry_point_exits_with_the_command_s_code_after_all_its_output():
    """`main` flushes and exits without the interpreter's teardown: the JSON is whole, the code kept."""
    import subprocess
    import sys

    command = [sys.executable, "-m", "streambp_bench.cli", *SIM, "--method", "checkpoint,streambp"]
    done = subprocess.run([*command, "--json", "--jobs", "2"], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr
    assert [r["method"] for r in json.loads(done.stdout)["results"]] == ["checkpoint", "streambp"]
    refused = subprocess.run([*command, "--budget-gib", "1e-4"], capture_output=True, text=True, timeout=300)
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.startswith("error:") and refused.stderr.count("\n") == 1
