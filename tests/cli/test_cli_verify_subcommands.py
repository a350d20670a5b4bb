"""`verify`'s subcommands: each lists its examples and only the options that apply to it; the bare command
stays the single-process gradient check, and the one-command verify's mode flags name the subcommand that
took them over (one `error:` line, exit 2)."""

from __future__ import annotations

import json

import pytest

from streambp_bench.cli import app
from streambp_bench.commands.verify.options import takes
from tests.cli.errors import one_line_error

SUBCOMMANDS = ("fsdp", "sp", "deepspeed", "trainer")
TINY = ["-m", "tiny/llama", "--dtype", "float64"]



def test_verify_help_lists_the_subcommands_and_their_examples(runner):
    result = runner.invoke(app, ["verify", "--help"])
    assert result.exit_code == 0, result.output
    assert "Commands" in result.output and "--ps-head" in result.output
    for subcommand in SUBCOMMANDS:
        assert f"streambp-bench verify {subcommand}" in result.output


@pytest.mark.parametrize("subcommand", SUBCOMMANDS)
def test_each_subcommand_help_has_example_invocations(runner, subcommand):
    result = runner.invoke(app, ["verify", subcommand, "--help"])
    assert result.exit_code == 0, result.output
    assert "Examples" in result.output
    assert f"streambp-bench verify {subcommand} " in result.output


def test_the_bare_verify_is_the_single_process_check_of_the_readme(runner):
    args = ["verify", *TINY, "--method", "all", "--ps", "8", "--ps-head", "8", "-T", "24", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert [row["method"] for row in report["results"]] == ["plain", "checkpoint", "mst", "streambp"]
    assert report["ok"] and all(row["max_rel_err"] <= 1e-10 for row in report["results"])


def test_verify_trainer_trains_as_plain_in_one_process(runner):
    args = ["verify", "trainer", "sft", *TINY, "-T", "24", "--ps", "8", "--ps-head", "8", "--method",
            "streambp", "--set", "max_steps=1", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (row,) = document["results"]
    assert (document["trainer"], document["source"], row["method"]) == ("sft", "measured-cpu", "streambp")
    assert row["ok"] and row["max_rel_error"] <= 1e-10


@pytest.mark.parametrize(("settings", "words"), [
    (["learning_rate=0"], ("learning_rate=0 trains nothing",)),
    (["max_steps=0"], ("max_steps=0 trains nothing",)),
    (["optim=adamw_torch", "adam_beta1=2"], ("optimizer", "Invalid beta parameter at index 0: 2")),
])
def test_verify_trainer_refuses_settings_it_cannot_judge(runner, settings, words):
    """A run that trains nothing would pass whatever a method does, and a setting the optimizer refuses
    fails inside training: both one `error:` line and exit 2 before anything trains."""
    args = ["verify", "trainer", "sft", *TINY, "-T", "16", "--method", "streambp"]
    result = runner.invoke(app, [*args, *(f"--set={s}" for s in settings)])
    (line,) = _stderr_lines(result)
    assert result.exit_code == 2 and line.startswith("error: "), result.output
    assert "Traceback" not in result.output and all(word in line for word in words), line


def _stderr_lines(result) -> list[str]:
    """`result`'s stderr lines but DeepSpeed's own log line as it is first imported (in the process's
    first trainer, when installed), which is the library's, not the command's."""
    return [line for line in result.stderr.splitlines() if line.strip() and "] [WARNING] [" not in line]


def test_verify_trainer_reports_a_broken_reference_not_the_method(runner):
    """Plain training that diverges (a learning rate that overflows the weights) is the reference broken:
    one line naming it and exit 1, no method judged against it."""
    args = ["verify", "trainer", "trainer", *TINY, "-T", "16", "--method", "streambp", "--set",
            "learning_rate=1e300", "--set", "max_steps=2"]
    result = runner.invoke(app, args)
    lines = _stderr_lines(result)
    assert result.exit_code == 1, result.output
    assert lines == ["error: the reference, plain training, trained to a non-finite update "
                     "(model.embed_tokens.weight): no method can be judged against it"], result.stderr
    assert "FAIL" not in result.output


@pytest.mark.parametrize(("args", "line"), [
    (["--nproc", "2"], "streambp-bench verify fsdp --nproc N"),
    (["--nproc=2", "--shard", "zero3"], "streambp-bench verify fsdp --nproc N"),
    (["--shard", "zero2"], "streambp-bench verify fsdp --nproc N"),
    (["--nproc", "2", "--sp", "2"], "streambp-bench verify sp --nproc N --sp S"),
    (["--nproc", "2", "--engine", "deepspeed"], "streambp-bench verify deepspeed --nproc N"),
    (["--trainer", "sft", "--nproc", "2"], "streambp-bench verify trainer sft"),
    (["--trainer", "trainer"], "streambp-bench verify trainer trainer"),
    (["--set", "weight_decay=0.1"], "streambp-bench verify trainer KIND"),
])
def test_a_mode_flag_of_the_bare_verify_names_its_subcommand(runner, args, line):
    one_line_error(runner.invoke(app, ["verify", *TINY, *args]), "is an option of a verify subcommand", line)


def test_an_option_before_the_subcommand_is_refused_not_dropped(runner):
    result = runner.invoke(app, ["verify", "-m", "tiny/llama", "fsdp", "--nproc", "2"])
    one_line_error(result, "--model before 'fsdp'", "streambp-bench verify fsdp --model")


@pytest.mark.parametrize(("subcommand", "option"), [
    (["fsdp"], "--lora-rank"), (["fsdp"], "--head-mode"), (["fsdp"], "--offload"), (["fsdp"], "--packing"),
    (["fsdp"], "--engine"), (["sp"], "--packing"), (["sp"], "--engine"), (["deepspeed"], "--device"),
    (["deepspeed"], "--offload"), (["deepspeed"], "--head-mode"), (["deepspeed"], "--sp"),
    (["trainer", "sft"], "--padding"), (["trainer", "sft"], "--objective"), (["trainer", "sft"], "--offload"),
    (["trainer", "sft"], "--head-mode"), (["trainer", "sft"], "--packing"), (["trainer", "sft"], "--sp"),
])
def test_a_subcommand_has_no_option_that_does_not_apply_to_it(runner, subcommand, option):
    result = runner.invoke(app, ["verify", *subcommand, *TINY, "--nproc", "2", option, "1"])
    one_line_error(result, f"No such option: {option}")


def test_a_subcommand_takes_only_options_that_exist():
    with pytest.raises(ValueError, match="no verify option"):
        takes("model", "nproc")
