"""Token counts on the command line: one parser for every length option of every command and benchmark.

A count is a number with an optional suffix (`SUFFIXES`): k = 1000, the paper's unit, as on every plot
axis and in every table (4k = 4000, 1.5k = 1500); ki = 1024 (4ki = 4096); m = 10^6 and mi = 2^20.
Lists are comma-separated counts and/or inclusive ranges START:STOP:STEP (`parse_token_list`); a
partition option also takes `auto` (`parse_partitions`). Bad text is a ConfigError of one line.

Nothing here imports torch or transformers, so bad input is refused at once.
"""

from __future__ import annotations

import argparse
import re
from collections.abc import Callable
from fractions import Fraction

from streambp_core.config import AUTO, ConfigError

SUFFIXES = {"": 1, "k": 1000, "ki": 1024, "m": 1_000_000, "mi": 2**20}
"""Token-count suffixes (case-insensitive)."""
UNITS = "k = 1000, ki = 1024"
"""How an option's help names the suffixes."""
MAX_GRID_POINTS = 10_000
"""Most values one list or range expands to, and most points one sweep runs: a larger grid is a typo
(a STEP of 1 token), refused before it is built."""

_NUMBER = re.compile(r"^(\d+(?:\.\d+)?)(k|ki|m|mi)?$", re.IGNORECASE)


def parse_tokens(text: str, what: str = "length", *, minimum: int = 1) -> int:
    """'4096' -> 4096, '4k' -> 4000, '1.5k' -> 1500, '4ki' -> 4096, '2m' -> 2,000,000 (`SUFFIXES`); a
    whole number of at least `minimum` tokens, else ConfigError naming `what`."""
    match = _NUMBER.match(text.strip())
    if not match:
        raise ConfigError(f"bad {what} {text!r}: give a valid integer, optionally with a suffix "
                          "(k = 1000: 4k = 4000; ki = 1024: 4ki = 4096; m = 10^6, mi = 2^20)")
    value = Fraction(match.group(1)) * SUFFIXES[(match.group(2) or "").lower()]  # exact: no float rounding
    if value.denominator != 1 or value < minimum:
        least = "a positive whole number" if minimum == 1 else f"a whole number, at least {minimum},"
        raise ConfigError(f"bad {what} {text!r}: must be {least} of tokens (it is {_shown(value)})")
    return int(value)


def _shown(value: Fraction) -> str:
    """`value` as a user reads it: 2500 or 1.5 (a fraction of a token to a few places)."""
    return str(value.numerator) if value.denominator == 1 else f"{float(value):.6g}"


def parse_token_list(text: str, what: str = "length") -> tuple[int, ...]:
    """A comma list of token counts and/or ranges START:STOP:STEP (inclusive), e.g. '1k,4k:16k:4k'; each
    value once, in the order given."""
    values: list[int] = []
    for item in (part.strip() for part in text.split(",")):
        if not item:
            continue
        if ":" in item:
            parts = item.split(":")
            if len(parts) != 3:
                raise ConfigError(f"bad {what} range {item!r}: use START:STOP:STEP, e.g. 4k:64k:4k")
            start, stop, step = (parse_tokens(part, what) for part in parts)
            if stop < start:
                raise ConfigError(f"bad {what} range {item!r}: STOP is below START")
            check_count(len(values) + len(range(start, stop + 1, step)), f"{what} list {text!r}")
            values.extend(range(start, stop + 1, step))
        else:
            values.append(parse_tokens(item, what))
    if not values:
        raise ConfigError(f"give at least one {what}")
    return tuple(dict.fromkeys(values))


def check_count(count: int, what: str, hint: str = "use a larger STEP") -> None:
    """ConfigError when `what` has more than MAX_GRID_POINTS values."""
    if count > MAX_GRID_POINTS:
        raise ConfigError(f"{what} has {count:,} points; a sweep runs at most {MAX_GRID_POINTS:,} ({hint})")


PARTITION_OPTIONS = {"--ps": ("partition size", "partition_size"),
                     "--ps-head": ("LM-head partition", "head_partition_size")}
"""Each partition option: what its values are called, and the step field it sets."""


def parse_partitions(text: str, option: str) -> tuple[int | str, ...]:
    """A partition option's value: a comma list of token counts and/or ranges (`parse_token_list`), or
    `config.AUTO` alone for 'auto' (in any case). ConfigError, one line, naming the value, the option
    (`PARTITION_OPTIONS`) and the field it sets."""
    what, field = PARTITION_OPTIONS[option]
    if text.strip().lower() == AUTO:
        return (AUTO,)
    try:
        return parse_token_list(text, what)
    except ConfigError as error:
        raise ConfigError(f"{error} ({option} sets {field}: positive numbers of tokens, {UNITS}, or auto)"
                          ) from None


class BadValue(ValueError, argparse.ArgumentTypeError):
    """A bad option value: what Typer (a ValueError) and argparse (an ArgumentTypeError) both report as one
    line naming the option."""


class BadTokenCount(BadValue):
    """A bad token count in an option's value."""


def token_count(what: str, minimum: int = 0) -> Callable[[str], int]:
    """A parser of one token count for an option's value (Typer's `parser=`, argparse's `type=`):
    `parse_tokens(text, what, minimum=minimum)`, its ConfigError as a `BadTokenCount`. The default
    minimum, 0, leaves the range to what checks the value (a StepSpec names the field it refuses)."""

    def parse(text: str | int) -> int:
        if isinstance(text, int):  # a default given as a number
            return text
        try:
            return parse_tokens(text, what, minimum=minimum)
        except ConfigError as error:
            raise BadTokenCount(str(error)) from None

    return parse


def partitions(option: str) -> Callable[[str], tuple[int | str, ...]]:
    """A parser of a partition option's value (Typer's `parser=`, argparse's `type=`): `parse_partitions`,
    its ConfigError as a `BadTokenCount`; a value already parsed (a default) passes as it is."""

    def parse(text: str | tuple) -> tuple[int | str, ...]:
        if isinstance(text, tuple):
            return text
        try:
            return parse_partitions(str(text), option)
        except ConfigError as error:
            raise BadTokenCount(str(error)) from None

    return parse
