"""Offload tiers: which parts of a training step live in host memory instead of on the device.

- checkpoints: what a method keeps between forward and backward (layer inputs), copied out in forward and
  back in backward (`engine.host.checkpoints`).
- optimizer: the optimizer's states and an fp32 master copy of every trainable parameter; each
  gradient goes to the host as soon as it is complete, the step runs there and the updated weights return
  (`engine.host.optimizer.HostAdamW`).
- params: the weights; each decoder layer's is gathered onto the device for its forward and again for its
  backward, one layer prefetched ahead, the embedding and the head when used (`engine.host.params`).

A set of tiers is one `Tiers` value, normalised once from whatever a user writes (`Tiers.of`), and read by
attribute (`tiers.optimizer`). It is written as one canonical string, `str(tiers)`: the tiers in the
order above joined by commas ("checkpoints,optimizer,params"), or "none". Pure Python: no torch, so bad
input is refused at once.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from itertools import combinations
from typing import ClassVar

from streambp_core.registry import method_class, methods_where

OFFLOAD_TIERS = ("checkpoints", "optimizer", "params")
"""Every tier, in canonical order."""
OFFLOAD_MODES = ("none", *(",".join(c) for n in range(1, 4) for c in combinations(OFFLOAD_TIERS, n)))
"""Every canonical tier set: none, each tier alone, each pair, all three."""
ALL_TIERS = ",".join(OFFLOAD_TIERS)


class TierError(ValueError):
    """A tier set that is not one (the caller turns it into its own error type)."""


@dataclass(frozen=True, kw_only=True)
class Tiers:
    """A set of offload tiers: one flag per tier. Hashable and compared by its flags; false when empty.

    Built from user input by `Tiers.of`; `str()` gives the canonical string every file and message shows."""

    checkpoints: bool = False
    """What the method keeps between forward and backward lives in host memory."""
    optimizer: bool = False
    """The optimizer's states, fp32 masters and step live in host memory."""
    params: bool = False
    """The weights live in host memory, gathered a layer at a time."""

    NONE: ClassVar[Tiers]
    """No tier: everything on the device."""
    ALL: ClassVar[Tiers]
    """Every tier."""

    def __post_init__(self) -> None:
        flags = {f.name: getattr(self, f.name) for f in fields(self)}
        if not all(isinstance(flag, bool) for flag in flags.values()):
            raise TierError(f"a tier is on or off (True or False), got {flags}")

    @classmethod
    def of(cls, value: Tiers | str | Iterable[str]) -> Tiers:
        """The tier set of a canonical string, a comma list or a collection of tier names (or a Tiers).

        Names are read without case or surrounding blanks; "none" (or nothing) is the empty set, "all"
        every tier. Unknown names raise TierError naming them."""
        if isinstance(value, Tiers):
            return value
        if not isinstance(value, str | Iterable):
            raise TierError(f"offload must be a tier name, a comma list or a collection of names, "
                            f"got {value!r}")
        names = value.split(",") if isinstance(value, str) else list(value)
        names = [str(name).strip().lower() for name in names if str(name).strip()]
        if names in ([], ["none"]):
            return cls.NONE
        if names == ["all"]:
            return cls.ALL
        unknown = [name for name in names if name not in OFFLOAD_TIERS]
        if unknown:
            raise TierError(f"offload must be one of none, {', '.join(OFFLOAD_TIERS)}, all or a comma list "
                            f"of tiers; unknown tier {', '.join(map(repr, unknown))}")
        return cls(**{tier: tier in names for tier in OFFLOAD_TIERS})

    @property
    def names(self) -> tuple[str, ...]:
        """The tiers that are on, in canonical order (none: ())."""
        return tuple(tier for tier in OFFLOAD_TIERS if getattr(self, tier))

    def __str__(self) -> str:
        return ",".join(self.names) or "none"

    def __bool__(self) -> bool:
        return bool(self.names)


Tiers.NONE = Tiers()
Tiers.ALL = Tiers(checkpoints=True, optimizer=True, params=True)


def tier_problem(method: str, tiers: Tiers, optimizer: str | None = None) -> str | None:
    """Why `method` cannot run with the tier set `tiers` (and `optimizer`, when known), in one line; None
    when it can.

    plain keeps no checkpoints and cannot stream layers (autograd holds every layer's weights from forward
    to backward), so it takes the optimizer tier only. With an optimizer, params needs optimizer: the
    weights the step updates live on the host, so the step runs there. The optimizer tier needs an
    optimizer to offload."""
    keeps = method_class(method).keeps_checkpoints
    if not keeps and tiers == Tiers(checkpoints=True):
        return f"offload does not apply to {method}: it keeps no checkpoints, so there is nothing to offload"
    if not keeps and (tiers.checkpoints or tiers.params):
        refused = [tier for tier in tiers.names if tier != "optimizer"]
        *first, last = methods_where(keeps_checkpoints=True)
        others = f"{', '.join(first)} or {last}" if first else last
        return (f"offload {','.join(refused)} does not apply to {method}: it keeps no checkpoints and cannot "
                f"stream layers (autograd holds every layer's weights from forward to backward); use "
                f"{others}, or offload optimizer only")
    if optimizer == "none" and tiers.optimizer:
        return "offload optimizer needs an optimizer (optimizer adamw): a backprop-only step has none"
    if optimizer not in (None, "none") and tiers.params and not tiers.optimizer:
        return ("offload params with an optimizer needs optimizer too: the weights the step updates live "
                "on the host, so the step runs there (offload optimizer,params)")
    return None


def tier_label(tiers: Tiers) -> str:
    """How a table names a tier set after the method: '' (none), '+ offload' (checkpoints, the label
    rows had before the other tiers existed), else '+ offload <tiers>'."""
    if not tiers:
        return ""
    return "+ offload" if tiers == Tiers(checkpoints=True) else f"+ offload {tiers}"
