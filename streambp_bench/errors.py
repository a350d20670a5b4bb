"""User-facing errors: one red `error:` line on stderr and exit code 2, never a traceback.

One place maps what a user can cause to that line: a bad option or model (`ConfigError`), a results
file of another schema or a damaged one (`SchemaError`), and file-system errors (`OSError`: a missing,
unreadable or unwritable path).
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from typing import Any, ParamSpec, TypeVar

import typer
from rich.console import Console
from rich.markup import escape
from typer.core import TyperGroup

from streambp_bench.interrupts import INTERRUPTED_EXIT_CODE, stop_fork_server
from streambp_core.config import ConfigError

USER_ERROR_EXIT_CODE = 2

P = ParamSpec("P")
R = TypeVar("R")


class SchemaError(ValueError):
    """A results file that is not in the current (or a known earlier) schema, or is damaged."""


USER_ERRORS = (ConfigError, SchemaError, OSError)
"""Exceptions that are the user's input, not a bug: printed as one line, exit 2."""


def print_error(error: BaseException) -> None:
    """Print `error` as a single red `error: ...` line on stderr (no wrapping, newlines folded)."""
    message = " ".join(str(error).split())
    if isinstance(error, OSError) and error.filename is not None and error.strerror:
        message = f"{error.filename}: {error.strerror}"
    Console(stderr=True, highlight=False).print(f"[bold red]error:[/] {escape(message)}", soft_wrap=True)


def user_errors(command: Callable[P, R]) -> Callable[P, R]:
    """Decorate a command so the `USER_ERRORS` become `print_error` and exit code 2."""

    @functools.wraps(command)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        try:
            return command(*args, **kwargs)
        except USER_ERRORS as error:
            print_error(error)
            raise typer.Exit(code=USER_ERROR_EXIT_CODE) from None
        except KeyboardInterrupt:  # Ctrl-C, e.g. while workers or ranks start: one line, no traceback
            stop_fork_server()
            print_error(ValueError("interrupted"))
            raise typer.Exit(code=INTERRUPTED_EXIT_CODE) from None

    return wrapper


class OneLineErrorsGroup(TyperGroup):
    """The app's command group: a usage error (an unknown option, a value outside its choices, a missing
    argument) is one `error:` line and exit 2, like every other bad input, instead of a usage panel."""

    def main(self, args: Any = None, prog_name: str | None = None, complete_var: str | None = None,
             standalone_mode: bool = True, **extra: Any) -> Any:
        if not standalone_mode:
            return super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        try:
            code = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
        except Exception as error:  # click's exceptions (typer may ship its own copy of click: duck-typed)
            if type(error).__name__ == "Abort":  # Ctrl-C (click turns KeyboardInterrupt into Abort)
                stop_fork_server()
                print_error(ValueError("interrupted"))
                sys.exit(INTERRUPTED_EXIT_CODE)
            if not (hasattr(error, "format_message") and hasattr(error, "exit_code")):
                raise
            hint = f" (see {error.ctx.command_path} --help)" if getattr(error, "ctx", None) else ""
            print_error(ValueError(error.format_message().replace("Value error, ", "") + hint))
            sys.exit(error.exit_code)
        sys.exit(code if isinstance(code, int) else 0)
