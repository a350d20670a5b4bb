"""The `streambp-bench` Typer app: wiring only; each command lives in `streambp_bench.commands`."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

import streambp_core
from streambp_bench.commands import max_len, plot, presets, reproduce, selfcheck, sweep, verify
from streambp_bench.errors import USER_ERROR_EXIT_CODE, USER_ERRORS, OneLineErrorsGroup, print_error

app = typer.Typer(
    name="streambp-bench",
    cls=OneLineErrorsGroup,
    help="StreamBP: exact, memory-efficient backpropagation for long sequences; verify and benchmark it.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)


def _version(value: bool) -> None:
    if value:
        typer.echo(f"streambp-bench {streambp_core.__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="Print the version and exit.")
    ] = False,
) -> None:
    """StreamBP: exact, memory-efficient backpropagation for long sequences; verify and benchmark it."""


app.command("max-len", help=max_len.HELP, epilog=max_len.EPILOG)(max_len.max_len)
app.command("verify", help=verify.HELP, epilog=verify.EPILOG)(verify.verify)
app.command("presets", help=presets.HELP, epilog=presets.EPILOG)(presets.presets)
app.command("plot")(plot.plot)
app.command("sweep", help=sweep.HELP, epilog=sweep.EPILOG)(sweep.sweep)
app.command("reproduce", help=reproduce.HELP, epilog=reproduce.EPILOG)(reproduce.reproduce)
app.command("selfcheck", help=selfcheck.HELP, epilog=selfcheck.EPILOG)(selfcheck.selfcheck)


def main() -> None:
    """Console-script entry point: run the app; a ConfigError that escapes a command is one line, exit 2."""
    try:
        app()
    except USER_ERRORS as error:
        print_error(error)
        sys.exit(USER_ERROR_EXIT_CODE)


if __name__ == "__main__":
    main()
