"""Each option of a training step is declared once (`streambp_bench.options.STEP_OPTIONS`): no command or
benchmark script declares its flag again, and every command that takes it shows the same help."""

from __future__ import annotations

import argparse
import ast
from pathlib import Path

import click
import pytest
import typer

from streambp_bench import options as opt
from streambp_bench.cli import app
from streambp_core.config import ConfigError

ROOT = Path(__file__).resolve().parents[2]
DECLARING_CALLS = ("Option", "add_argument", "StepOption")
"""Calls that declare a flag: Typer's option, argparse's argument, the table's entry."""
OTHER_MEANINGS = {("--optimizer", "streambp_bench/commands/verify/ranks.py")}
"""Flags a command declares with another meaning: verify deepspeed's --optimizer is the client optimizer
DeepSpeed steps (adam or sgd), not the step's."""
FLAGS = {flag: option for option in opt.STEP_OPTIONS.values() for flag in option.flags}


def declarations(flag: str) -> list[str]:
    """'path:line' of every call in the CLI and the benchmark scripts that declares `flag`."""
    found = []
    for path in sorted([*(ROOT / "streambp_bench").rglob("*.py"), *(ROOT / "benchmarks").glob("*.py")]):
        where = path.relative_to(ROOT).as_posix()
        if (flag, where) in OTHER_MEANINGS:
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            name = getattr(node, "func", None)
            if getattr(name, "attr", getattr(name, "id", None)) not in DECLARING_CALLS:
                continue
            values = [item for arg in node.args
                      for item in (arg.elts if isinstance(arg, ast.Tuple) else [arg])]
            if any(isinstance(value, ast.Constant) and value.value == flag for value in values):
                found.append(f"{where}:{node.lineno}")
    return found


@pytest.mark.parametrize("flag", sorted(FLAGS))
def test_a_step_flag_is_declared_once_in_the_source(flag: str) -> None:
    (declared,) = declarations(flag)
    assert declared.startswith("streambp_bench/options.py:")


def _commands() -> dict[str, click.Command]:
    """Every command of the app that may take step options, by its command line ('verify fsdp', ...)."""
    root = typer.main.get_command(app)
    found = {}
    for name in ("max-len", "sweep", "plan", "verify"):
        command = root.commands[name]
        found[name] = command
        for sub, subcommand in getattr(command, "commands", {}).items():
            found[f"{name} {sub}"] = subcommand
    return found


def test_every_command_taking_a_step_option_shows_the_tables_help() -> None:
    taken: dict[str, set[str]] = {}
    for line, command in _commands().items():
        for parameter in command.params:
            flag = next((flag for flag in parameter.opts if flag in FLAGS), None)
            if flag is None or (line, flag) == ("verify deepspeed", "--optimizer"):
                continue
            assert parameter.help == FLAGS[flag].help, (line, flag)
            taken.setdefault(FLAGS[flag].name, set()).add(line)
    for name in ("ps", "ps_head"):
        assert {"max-len", "sweep", "verify", "verify fsdp", "verify sp", "verify trainer"} <= taken[name]
    assert {"max-len", "sweep", "plan", "verify"} <= taken["optimizer"]


def test_a_benchmark_script_takes_the_same_option_and_refuses_what_it_cannot_run() -> None:
    parser = argparse.ArgumentParser()
    opt.add_step_arguments(parser, ps=None, ps_head="1024,100", dtype="float32")
    args = parser.parse_args(["--ps", "2k", "--dtype", "float64"])
    assert parser._option_string_actions["--ps"].help == opt.STEP_OPTIONS["ps"].help.replace("%", "%%")
    sizes = opt.step_fields({"ps": args.ps, "ps_head": args.ps_head}, listed=("ps_head",), automatic=False)
    assert sizes == {"partition_size": 2000, "head_partition_size": (1024, 100)} and args.dtype == "float64"
    with pytest.raises(ConfigError, match="--ps auto: .* this command runs the sizes given"):
        opt.step_fields({"ps": parser.parse_args(["--ps", "auto"]).ps}, automatic=False)
    with pytest.raises(ConfigError, match="--ps takes one size here, got 2"):
        opt.step_fields({"ps": parser.parse_args(["--ps", "1k,2k"]).ps})
