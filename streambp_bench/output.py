"""One output sink for every command that reports results: tables for people, `--json` for machines.

Numbers are computed before anything is printed; a command hands `emit` the JSON document and a function
that renders the same figures as tables. Progress and notes go to stderr, so stdout holds only the report.
"""

from __future__ import annotations

import json
import math
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
    """Print `document` as JSON (`as_json`; a NaN or infinite number as null, so the text is valid JSON)
    or call `render(console)` to print it as tables."""
    if as_json:
        typer.echo(json.dumps(finite(document), indent=2, default=str, allow_nan=False))
        return
    render(stdout_console())


def finite(value: Any) -> Any:
    """`value` with every NaN or infinite float, at any depth of dicts, lists and tuples, as None (JSON's
    null: a figure that could not be computed; the document's status or ok fields say why)."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {key: finite(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [finite(item) for item in value]
    return value
