"""User-facing errors: one red line on stderr and exit code 2, never a traceback."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape

from streambp_core.config import ConfigError

USER_ERROR_EXIT_CODE = 2

P = ParamSpec("P")
R = TypeVar("R")


def print_error(error: Exception) -> None:
    """Print `error` as a single red `error: ...` line on stderr (no wrapping, newlines folded)."""
    message = " ".join(str(error).split())
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Decorate a command so a ConfigError becomes `print_error` and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except ConfigError as error:
            print_error(error)
            raise typer.Exit(code=USER_ERROR_EXIT_CODE) from None

    return wrapper
