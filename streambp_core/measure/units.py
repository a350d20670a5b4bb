"""Units shared by the measurement code: GiB = 2**30 bytes everywhere."""

from __future__ import annotations

GIB = 2**30
"""Bytes per GiB."""


def bytes_to_gib(num_bytes: int | float) -> float:
    """Convert a byte count to GiB (2**30 bytes)."""
    return num_bytes / GIB


class gib_of:  # lower case: reads like a function in a class body, `peak_gib = gib_of("peak_bytes")`
    """A read-only attribute: the byte count in attribute `field`, in GiB (None where that is None)."""

    def __init__(self, field: str) -> None:
        self.field = field

    def __get__(self, instance: object, owner: type | None = None) -> float | None:
        if instance is None:
            return self  # type: ignore[return-value]  # the descriptor itself, read on the class
        num_bytes = getattr(instance, self.field)
        return None if num_bytes is None else bytes_to_gib(num_bytes)


def format_size(num_bytes: float) -> str:
    """'1.50 GiB', or 'x.x MiB' below 1 GiB (so a tiny budget does not read 0.00 GiB)."""
    if num_bytes >= GIB:
        return f"{num_bytes / GIB:.2f} GiB"
    return f"{num_bytes / 2**20:.1f} MiB"


def memory_unit(values_gib) -> tuple[float, str]:
    """(factor from GiB, unit) for showing `values_gib` together: MiB when every value is below 1 GiB (so
    small models do not read 0.00), else GiB."""
    values = [abs(float(v)) for v in values_gib]
    return (1024.0, "MiB") if values and max(values) < 1.0 else (1.0, "GiB")
