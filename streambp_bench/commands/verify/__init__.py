"""`streambp-bench verify`: the group. Without a subcommand it is the single-process gradient check
(`grads`); `fsdp`, `sp` and `deepspeed` check across ranks (`ranks`), `trainer` checks training (`trainer`).
Each takes only the options that apply to it, so no check refuses another's options.

The one-command verify's mode flags (--nproc, --sp, --engine, --trainer and theirs) are not aliases: on the
bare command each is one `error:` line naming the subcommand that takes it (`VerifyGroup`).
"""

from __future__ import annotations

import typer
from typer.core import TyperGroup

from streambp_bench.commands.verify import grads, ranks, trainer

MODE_FLAGS = ("--trainer", "--data", "--set", "--sp", "--engine", "--nproc", "--shard")
"""The one-command verify's mode flags, in the order that picks the subcommand a call meant."""


def subcommand_for(args: list[str]) -> tuple[str, str] | None:
    """(flag, the subcommand line that takes it) for the first mode flag in `args`, else None."""
    given = {arg.split("=", 1)[0]: index for index, arg in enumerate(args) if arg.startswith("--")}
    flag = next((flag for flag in MODE_FLAGS if flag in given), None)
    if flag is None:
        return None
    if flag in ("--trainer", "--data", "--set"):
        index = given.get("--trainer")
        kind = args[index + 1] if index is not None and index + 1 < len(args) else "KIND"
        return flag, f"verify trainer {kind}"
    if flag == "--sp":
        return flag, "verify sp --nproc N --sp S"
    engine = given.get("--engine")
    if engine is not None and args[engine + 1:engine + 2] == ["deepspeed"]:
        return flag, "verify deepspeed --nproc N"
    return flag, "verify fsdp --nproc N"


class VerifyGroup(TyperGroup):
    """`verify`'s group: a mode flag of the one-command verify on the bare command is a usage error naming
    the subcommand to run instead (one `error:` line and exit 2, by the app's `OneLineErrorsGroup`)."""

    def parse_args(self, ctx: typer.Context, args: list[str]) -> list[str]:
        named = any(arg in self.commands and (index == 0 or args[index - 1] not in MODE_FLAGS)
                    for index, arg in enumerate(args))
        moved = None if named else subcommand_for(args)
        if moved is not None:
            flag, line = moved
            ctx.fail(f"{flag} is an option of a verify subcommand: run streambp-bench {line} (the other "
                     "options as before)")
        return super().parse_args(ctx, args)


app = typer.Typer(name="verify", cls=VerifyGroup, rich_markup_mode="rich", add_completion=False,
                  pretty_exceptions_show_locals=False)
app.callback(invoke_without_command=True, help=grads.HELP, epilog=grads.EPILOG)(grads.verify)
app.command("fsdp", help=ranks.FSDP_HELP, epilog=ranks.FSDP_EPILOG)(ranks.fsdp)
app.command("sp", help=ranks.SP_HELP, epilog=ranks.SP_EPILOG)(ranks.sp)
app.command("deepspeed", help=ranks.DEEPSPEED_HELP, epilog=ranks.DEEPSPEED_EPILOG)(ranks.deepspeed)
app.command("trainer", help=trainer.HELP, epilog=trainer.EPILOG)(trainer.trainer)
