"""docs/cli.md's "Bad input" promise across commands: one `error:` line on stderr, exit 2, before any work;
and the numbers a hostile user tries (nan, inf, negative, zero) on every command that takes them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from tests.cli.errors import benchmark_script, error_line, one_line_error

REPO = Path(__file__).parents[2]
FIXTURES = REPO / "tests" / "fixtures"
TINY = ["-m", "tiny/llama"]


@pytest.mark.parametrize("number", ["nan", "inf", "-inf", "-1", "0"])
@pytest.mark.parametrize(
    "command", [["max-len", *TINY], ["sweep", *TINY], ["plot", str(FIXTURES / "max_len.csv")]]
)
def test_every_budget_is_a_finite_positive_number(tmp_path: Path, command: list[str], number: str) -> None:
    result = CliRunner().invoke(app, [*command, "--budget-gib", number, "--out", str(tmp_path / "o.csv")])
    one_line_error(result, "--budget-gib must be a finite positive number")
    assert list(tmp_path.iterdir()) == []


BAD_OPTIONS = {
    "verify": [("-T 1", "seq_len"), ("--seq-len 1", "seq_len"),
               ("--seq-len abc", "'--seq-len'", "valid integer"), ("--batch-size 0", "batch_size"),
               ("--ps 0", "partition_size"), ("--ps-head 0", "head_partition_size"),
               ("--lora-rank -1", "lora rank"), ("--method streambp,magic", "magic"),
               ("--model no/such-model", "presets: ")],
    "max-len": [("-b 0", "batch_size"), ("--batch-size 0", "batch_size"), ("--jobs 0", "--jobs"),
                ("--ps -3", "partition_size"), ("--ps 0", "partition_size"),
                ("--ps-head -3", "head_partition_size"), ("--method plain,adam", "unknown method 'adam'"),
                ("--model no/such-model", "unknown model")],
    "sweep": [("--seq-len nan", "bad length 'nan'", "k = 1000"), ("--seq-len inf", "bad length 'inf'"),
              ("--seq-len -1k", "bad length '-1k'"), ("--seq-len 4x", "bad length"),
              ("--seq-len 0.5", "whole number"), ("--seq-len 2:1000000000:1", "at most 10,000"),
              ("--ps nan", "bad partition size 'nan'"), ("--ps 0", "partition size"),
              ("--ps-head 0", "head_partition_size"), ("--lora-rank -1", "lora rank"),
              ("--method nope", "unknown method"), ("--optimizer sgd", "optimizer"),
              ("--device tpu", "Invalid value for '--device'"), ("-m no/such-model", "unknown model")],
}
"""Per command, options a user gets wrong (given after `TINY`) and the words of the error line each gets."""


@pytest.mark.parametrize(("command", "options", "words"), [
    (command, options, words) for command, cases in BAD_OPTIONS.items() for options, *words in cases])
def test_bad_options_are_one_line_before_any_work(tmp_path: Path, command: str, options: str,
                                                  words: list[str]) -> None:
    """Exit 2 and one `error:` line naming what is wrong, and nothing written (a sweep is given --out)."""
    out = ["--out", str(tmp_path / "o.csv")] if command == "sweep" else []
    one_line_error(CliRunner().invoke(app, [command, *TINY, *options.split(), *out]), *words)
    assert list(tmp_path.iterdir()) == []


def test_sweep_writes_into_the_current_folder_by_default(tmp_path: Path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)
    result = CliRunner().invoke(app, ["sweep", *TINY, "--seq-len", "0.064k", "--method", "checkpoint",
                                      "--device", "sim", "--budget-gib", "1"])
    assert result.exit_code == 0, result.output
    written = [p.name for p in tmp_path.iterdir() if not p.name.startswith(".")]  # .sweep.csv.lock: the lock
    assert written == ["sweep.csv"]  # not results/sweep.csv
    rows = ResultsFile(tmp_path / "sweep.csv").rows()
    assert [row.seq_len_tokens for row in rows] == [64]  # 0.064k: k = 1000


def test_max_len_tables_of_a_small_budget_are_in_mib(stub_probe) -> None:
    sizes = ["--ps", "32", "--ps-head", "16", "--budget-gib", "0.003"]
    result = CliRunner().invoke(app, ["max-len", *TINY, "--method", "streambp", "--device", "sim", *sizes])
    assert result.exit_code == 0, result.output
    assert "peak MiB" in result.stdout and "by category, MiB" in result.stdout
    assert " 0.00 " not in result.stdout


def _profile_step():
    return benchmark_script("profile_step")


PROFILE = ["--model", "tiny/qwen3", "--device", "cpu"]


BENCHMARK_BAD_INPUT = {
    "profile_step": [([*PROFILE, "--seq-len", "0"], "seq_len must be"),
                     ([*PROFILE, "--ps-head", "abc"], "bad LM-head partition 'abc'"),
                     ([*PROFILE, "--methods", "nosuch"], "unknown method 'nosuch'"),
                     (["--model", "nosuch", "--device", "cpu"], "unknown model 'nosuch'")],
    "fsdp_rank_memory": [(["--shards", "zero1"], "shard must be one of"),
                         (["--shards", "deepspeed-zero2"], "torch FSDP2"),
                         (["--methods", "nosuch"], "unknown method 'nosuch'"),
                         (["--gpus", "1"], "--gpus must be at least 2"),
                         (["--gpus", "4096"], "more than the")],
    "deepspeed_rank_memory": [(["--shards", "zero2"], "DeepSpeed rank is measured as the layouts"),
                              (["--gpus", "1"], "--gpus must be at least 2")],
    "step_flops": [(["--ps-head", "abc"], "bad LM-head partition 'abc'"),
                   (["--head-modes", "fast"], "head modes are", "not fast"),
                   (["--seq-len", "0"], "--seq-len must be at least 1"),
                   (["--auto-budget-gib", "lots"], "bad --auto-budget-gib 'lots'"),
                   (["--model", "nosuch"], "unknown model 'nosuch'")],
    "step_time_estimate": [(["--gpu", "v100"], "unknown GPU model 'v100'"),
                           (["--methods", "nosuch"], "unknown method 'nosuch'"),
                           (["--seq-len", "4q"], "bad length '4q'"),
                           (["--measured", str(REPO / "README.md")],
                            "is not a results CSV", "no column metric")],
}
"""Per benchmark script (benchmarks/<name>.py), arguments a user gets wrong and the words of the error
line each gets."""


@pytest.mark.parametrize(("script", "args", "words"), [
    (script, args, words) for script, cases in BENCHMARK_BAD_INPUT.items() for args, *words in cases])
def test_a_benchmark_s_bad_input_is_one_line_before_any_work(script, args, words, monkeypatch, capsys):
    """profile_step reads sys.argv, the others take their arguments: either way exit 2, one line."""
    monkeypatch.setattr(sys, "argv", [f"{script}.py", *args])
    module = benchmark_script(script)
    assert (module.main() if script == "profile_step" else module.main(args)) == 2
    error_line(capsys.readouterr().err, *words)


def test_profile_step_checks_its_out_before_any_work(tmp_path: Path, monkeypatch, capsys) -> None:
    damaged = tmp_path / "profile.csv"
    damaged.write_bytes(b"\x89PNG\x00\xff")
    monkeypatch.setattr(sys, "argv", ["profile_step.py", "--model", "tiny/qwen3", "--device", "cpu",
                                      "--seq-len", "32", "--out", str(damaged)])
    module = _profile_step()
    monkeypatch.setattr(module, "build_model", lambda *a, **k: pytest.fail("built a model before --out"))
    assert module.main() == 2
    assert "not a text CSV" in capsys.readouterr().err


def test_a_cpu_sweep_point_that_would_not_fit_in_ram_is_not_run(tmp_path: Path, monkeypatch) -> None:
    from streambp_core.measure import host_ram

    monkeypatch.setattr(host_ram, "available_ram_bytes", lambda: 2**20)  # 1 MiB of RAM: nothing fits
    monkeypatch.setattr("streambp_core.step.run.setup.build_setup",
                        lambda *a, **k: pytest.fail("built a model"))
    out = tmp_path / "cpu.csv"
    result = CliRunner().invoke(app, ["sweep", *TINY, "--device", "cpu", "--seq-len", "64", "--method",
                                      "checkpoint", "--out", str(out)])
    assert result.exit_code == 0, result.output
    rows = ResultsFile(out).rows()
    assert {row.status for row in rows} == {"oom"} and {row.metric for row in rows} == {"peak_memory",
                                                                                        "step_time"}
    assert all(row.error.startswith("not run: needs ~") and "GiB of RAM" in row.error for row in rows)


@pytest.mark.parametrize(
    ("args", "option"),
    [(["--budget-gib", "1e308"], "--budget-gib"), (["--budget-gib", "2e6"], "--budget-gib"),
     (["--offload", "checkpoints", "--host-budget-gib", "1e308"], "--host-budget-gib")],
)
def test_a_budget_past_a_pib_is_one_line_not_an_overflow(args: list[str], option: str) -> None:
    """1e308 GiB has no byte count (inf): it was an OverflowError traceback after every precheck."""
    result = CliRunner().invoke(app, ["max-len", *TINY, "--device", "sim", *args])
    one_line_error(result, f"{option} must be a finite positive number", "at most 1,048,576")


def test_a_host_budget_without_offload_is_refused_not_ignored() -> None:
    result = CliRunner().invoke(app, ["max-len", *TINY, "--device", "sim", "--host-budget-gib", "64"])
    one_line_error(result, "--host-budget-gib", "give --offload")


def _qwen3_5_dir(tmp_path: Path, **values) -> Path:
    from streambp_core.models.load import PRESET_DIR

    config = {**json.loads((PRESET_DIR / "tiny--qwen3.5.json").read_text()), **values}
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "config.json").write_text(json.dumps(config))
    return tmp_path / "model"


@pytest.mark.parametrize("command", [["verify", "-T", "8"], ["max-len", "--budget-gib", "1"]])
def test_gated_deltanet_value_heads_must_be_a_multiple_of_key_heads(tmp_path: Path, command) -> None:
    """Qwen3.5's linear attention repeats each key head value/key times: 3 value heads over 2 key heads
    was a 300-line shape traceback from inside transformers after the start."""
    folder = _qwen3_5_dir(tmp_path, linear_num_value_heads=3)
    one_line_error(CliRunner().invoke(app, [*command, "-m", str(folder)]),
                   "linear_num_value_heads 3 is not a multiple of linear_num_key_heads 2")


def test_build_model_refuses_gated_deltanet_heads_that_do_not_divide() -> None:
    from streambp_core.config import ConfigError
    from streambp_core.models.load import build_model, tiny_config

    with pytest.raises(ConfigError, match="linear_num_value_heads 3 is not a multiple"):
        build_model(tiny_config("qwen3.5", linear_num_value_heads=3))
