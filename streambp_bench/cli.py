"""The `streambp-bench` Typer app: wiring only; each command lives in `streambp_bench.commands`."""

from __future__ import annotations

import sys

import typer

from streambp_bench.commands import max_len, plot, presets, reproduce, selfcheck, sweep, verify
from streambp_bench.errors import USER_ERROR_EXIT_CODE, print_error
from streambp_core.config import ConfigError

app = typer.Typer(
    name="streambp-bench",
    help="StreamBP: exact, memory-efficient backpropagation for long sequences; verify and benchmark it.",
    rich_markup_mode="rich",
    no_args_is_help=True,
    pretty_exceptions_show_locals=False,
    add_completion=False,
)
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
    except ConfigError as error:
        print_error(error)
        sys.exit(USER_ERROR_EXIT_CODE)
