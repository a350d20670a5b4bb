"""One output sink for every command that reports results: tables for people, `--json` for machines.

Numbers are computed before anything is printed; a command hands `emit` the JSON document and a function
that renders the same figures as tables. Progress and notes go to stderr, so stdout holds only the report.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from typing import Any

import typer
from rich.console import Console


def stdout_console() -> Console:
    """The console for reports: no highlighting, wide enough not to cut a table when not on a terminal."""
    console = Console(highlight=False)
    if not console.is_terminal:
        console = Console(highlight=False, width=max(console.width, 200))
    return console


def stderr_console() -> Console:
    """The console for progress and notes."""
    return Console(stderr=True, highlight=False)


def emit(document: dict[str, Any] | list[Any], as_json: bool, render: Callable[[Console], None]) -> None:
    """Print `document` as JSON (`as_json`) or call `render(console)` to print it as tables."""
    if as_json:
        typer.echo(json.dumps(document, indent=2, default=str))
        return
    render(stdout_console())
