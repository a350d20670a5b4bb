"""The one check every CLI test of bad input makes: exit 2 and one `error:` line on stderr; and loading a
benchmark script (benchmarks/*.py) to check its bad input the same way."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"


def one_line_error(result, *words: str) -> str:
    """Assert `result` (a CliRunner result) failed with exit 2 and exactly one `error:` line on stderr,
    no traceback, holding every one of `words`; return that line."""
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert result.exit_code == 2, result.output
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    assert "Traceback" not in result.output and all(word in lines[0] for word in words), lines[0]
    return lines[0]


def error_line(stderr: str, *words: str) -> str:
    """Assert `stderr` (a script's) is exactly one `error:` line holding every one of `words`; return it."""
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines
    return lines[0]


def benchmark_script(name: str) -> ModuleType:
    """benchmarks/<name>.py as a module (its folder on sys.path while it loads: scripts import siblings)."""
    sys.path.insert(0, str(BENCHMARKS))
    try:
        spec = importlib.util.spec_from_file_location(name, BENCHMARKS / f"{name}.py")
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # a script's dataclasses look their module up while it loads
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(BENCHMARKS))
    return module
