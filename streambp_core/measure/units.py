"""Units shared by the measurement code: GiB = 2**30 bytes everywhere."""

from __future__ import annotations

GIB = 2**30
"""Bytes per GiB."""


def bytes_to_gib(num_bytes: int | float) -> float:
    """Convert a byte count to GiB (2**30 bytes)."""
    return num_bytes / GIB
