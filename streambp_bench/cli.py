"""The `streambp-bench` Typer app: wiring only; each command lives in `streambp_bench.commands`."""

from __future__ import annotations

import os
import sys
from typing import Annotated

from streambp_bench import interrupts

_loading = interrupts.handled()
_loading.__enter__()  # Ctrl-C while the modules below load is one line and exit 130 too

import typer  # noqa: E402 (below the handler)

import streambp_core  # noqa: E402
from streambp_bench.commands import (  # noqa: E402
    max_len,
    plan,
    plot,
    presets,
    reproduce,
    selfcheck,
    sweep,
    verify,
)
from streambp_bench.errors import (  # noqa: E402
    USER_ERROR_EXIT_CODE,
    USER_ERRORS,
    OneLineErrorsGroup,
    print_error,
)

_loading.__exit__(None, None, None)

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
app.command("plan", help=plan.HELP, epilog=plan.EPILOG)(plan.plan)
app.add_typer(verify.app, name="verify")
app.command("presets", help=presets.HELP, epilog=presets.EPILOG)(presets.presets)
app.command("plot")(plot.plot)
app.command("sweep", help=sweep.HELP, epilog=sweep.EPILOG)(sweep.sweep)
app.command("reproduce", help=reproduce.HELP, epilog=reproduce.EPILOG)(reproduce.reproduce)
app.command("selfcheck", help=selfcheck.HELP, epilog=selfcheck.EPILOG)(selfcheck.selfcheck)


def main() -> None:
    """Run the app; a ConfigError that escapes a command is one line, exit 2 (SystemExit, so a caller in
    Python keeps its process)."""
    try:
        app()
    except USER_ERRORS as error:
        print_error(error)
        sys.exit(USER_ERROR_EXIT_CODE)
    except KeyboardInterrupt:  # outside a command's own handling (`errors.user_errors`)
        print_error(ValueError("interrupted"))
        sys.exit(interrupts.INTERRUPTED_EXIT_CODE)


def run() -> None:
    """Console-script entry point: `main` under `interrupts.on_sigint` (Ctrl-C anywhere is one line and
    exit 130), then `exit_now` with its exit code."""
    try:
        with interrupts.handled():
            main()
        code: object = 0
    except SystemExit as done:
        code = done.code
    exit_now(code)


def exit_now(code: object) -> None:
    """Exit with `code` (SystemExit's meaning) once stdout and stderr are flushed, skipping the interpreter's
    teardown when torch is loaded: tearing down torch's and transformers' modules takes 1-2 s and frees
    nothing a finished command holds (its files are written and closed, its worker processes joined)."""
    if not isinstance(code, int) and code is not None:
        print(code, file=sys.stderr)
        code = 1
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):  # a closed pipe (`| head`) or stream: nothing more to deliver
            pass
    if "torch" not in sys.modules:
        sys.exit(code)
    os._exit(code or 0)


if __name__ == "__main__":
    run()
