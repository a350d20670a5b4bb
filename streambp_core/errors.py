"""The one error a user's input raises anywhere in the library: the CLI prints its message on one line."""

from __future__ import annotations


class ConfigError(ValueError):
    """A user-facing configuration error; the CLI prints its message on one line."""
