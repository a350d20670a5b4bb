"""Peak memory by category, in GiB, for reports and result rows."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass

from streambp_core.measure.result import TrackerResult
from streambp_core.measure.tags import CATEGORIES
from streambp_core.measure.units import bytes_to_gib


@dataclass(frozen=True, kw_only=True)
class Breakdown:
    """Memory per category in GiB (2**30 bytes); `total_gib` is their sum."""

    weights_gib: float = 0.0
    grads_gib: float = 0.0
    optimizer_gib: float = 0.0
    checkpoints_gib: float = 0.0
    kv_gib: float = 0.0
    logits_gib: float = 0.0
    temporaries_gib: float = 0.0

    @classmethod
    def from_bytes(cls, bytes_by_category: Mapping[str, int]) -> Breakdown:
        """Build from a {category: bytes} mapping; unknown categories raise ValueError."""
        unknown = set(bytes_by_category) - set(CATEGORIES)
        if unknown:
            raise ValueError(f"unknown memory categories {sorted(unknown)}; known: {', '.join(CATEGORIES)}")
        return cls(**{f"{name}_gib": bytes_to_gib(n) for name, n in bytes_by_category.items()})

    @classmethod
    def from_result(cls, result: TrackerResult, *, at: str = "peak") -> Breakdown:
        """The breakdown of a tracker result at its peak (`at="peak"`) or at its end (`at="end"`)."""
        if at not in ("peak", "end"):
            raise ValueError(f"at must be 'peak' or 'end', got {at!r}")
        return cls.from_bytes(result.peak_breakdown_bytes if at == "peak" else result.end_breakdown_bytes)

    @property
    def total_gib(self) -> float:
        """Sum over categories."""
        return sum(asdict(self).values())

    def as_dict(self) -> dict[str, float]:
        """{"weights_gib": ..., ..., "temporaries_gib": ..., "total_gib": ...} in category order."""
        return {**asdict(self), "total_gib": self.total_gib}
