"""Units shared by the measurement code: GiB = 2**30 bytes everywhere."""

from __future__ import annotations

GIB = 2**30
"""Bytes per GiB."""


def bytes_to_gib(num_bytes: int | float) -> float:
    """Convert a byte count to GiB (2**30 bytes)."""
    return num_bytes / GIB


def format_size(num_bytes: float) -> str:
    """'1.50 GiB', or 'x.x MiB' below 1 GiB (so a tiny budget does not read 0.00 GiB)."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"
