"""The prose of `results/README.md`, kept as Markdown in `readme_template.md` (package data) rather than
as Python strings: named blocks, each from its `<!-- block: NAME -->` line to the next, whose `{fields}`
the section using the block fills (`str.format`)."""

from __future__ import annotations

import functools
import re
from importlib import resources

TEMPLATE = "readme_template.md"
"""The template's file name in this package."""

_MARKER = re.compile(r"^<!-- block: ([\w-]+) -->$", re.MULTILINE)


@functools.cache
def blocks() -> dict[str, str]:
    """Every block of the template, name -> text (without the blank lines around it)."""
    text = resources.files(__package__).joinpath(TEMPLATE).read_text(encoding="utf-8")
    parts = _MARKER.split(text)[1:]  # name, text, name, text, ...
    return {name: body.strip("\n") for name, body in zip(parts[::2], parts[1::2], strict=True)}


def prose(name: str, **fields: object) -> str:
    """Block `name` of the template with its `{fields}` filled (KeyError: no such block)."""
    text = blocks()[name]
    return text.format(**fields) if fields else text
