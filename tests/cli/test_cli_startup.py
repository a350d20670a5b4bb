"""`streambp-bench --help` starts fast: importing the CLI must not import torch, transformers, pandas or
matplotlib (each command imports what it runs inside its function). Checked in a fresh interpreter, since
this test process has long imported them all. The default run checks the CLI, which imports every command
module and the light modules; `-m slow` checks each of them alone, to name the one that imports too much."""

from __future__ import annotations

import json
import pkgutil
import subprocess
import sys

import pytest

import streambp_bench.commands
import streambp_core

HEAVY = ("torch", "transformers", "pandas", "matplotlib")

COMMANDS = sorted(module.name for module in pkgutil.iter_modules(streambp_bench.commands.__path__))


def heavy_modules_after(statement: str) -> list[str]:
    """The HEAVY modules a fresh interpreter has imported after running `statement`."""
    report = f"print(json.dumps(sorted(m for m in {HEAVY!r} if m in sys.modules)))"
    code = f"{statement}\nimport json, sys\n{report}"
    completed = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    return json.loads(completed.stdout)


def test_the_probe_sees_a_heavy_import():
    assert heavy_modules_after("import pandas") == ["pandas"]


def test_the_commands_are_found():
    assert {"max_len", "plot", "presets", "reproduce", "selfcheck", "sweep", "verify"} <= set(COMMANDS)


@pytest.mark.slow  # the CLI imports every command module: test_importing_the_cli_imports_no_heavy_module
@pytest.mark.parametrize("command", COMMANDS)
def test_importing_a_command_module_imports_no_heavy_module(command):
    assert heavy_modules_after(f"import streambp_bench.commands.{command}") == []


@pytest.mark.slow  # the CLI imports each of them too
@pytest.mark.parametrize(
    "module", ["streambp_core", "streambp_core.config", "streambp_bench.options", "streambp_bench.errors"]
)
def test_importing_a_light_module_imports_no_heavy_module(module):
    assert heavy_modules_after(f"import {module}") == []


def test_importing_the_cli_imports_no_heavy_module():
    assert heavy_modules_after("import streambp_bench.cli") == []


def test_the_lazy_names_of_streambp_core_are_the_methods_module_s():
    from streambp_core import Run, prepare
    from streambp_core.methods import Run as methods_run
    from streambp_core.methods import prepare as methods_prepare

    assert (prepare, Run) == (methods_prepare, methods_run)
    assert streambp_core.prepare is methods_prepare
    assert {"prepare", "Run", "ConfigError", "__version__"} <= set(dir(streambp_core))
    assert set(streambp_core.__all__) <= set(dir(streambp_core))


def test_an_unknown_name_of_streambp_core_is_an_attribute_error():
    with pytest.raises(AttributeError, match="no_such_name"):
        streambp_core.no_such_name  # noqa: B018
