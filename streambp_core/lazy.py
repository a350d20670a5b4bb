"""Public names a package imports from their modules on first use (PEP 562), so importing the package
stays light (no torch or transformers until a heavy name is used)."""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Iterable


def lazy_attributes(
    package: str, modules: dict[str, str], public: Iterable[str]
) -> tuple[Callable[[str], object], Callable[[], list[str]]]:
    """`(__getattr__, __dir__)` for `package`: a name in `modules` is imported from its module on first
    access and kept in the package's namespace; any other name is an AttributeError."""
    namespace = sys.modules[package]

    def getattr_(name: str) -> object:
        if name not in modules:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(modules[name]), name)
        setattr(namespace, name, value)
        return value

    def dir_() -> list[str]:
        return sorted({*vars(namespace), *public})

    return getattr_, dir_
