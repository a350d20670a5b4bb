"""Offload tiers: which parts of a training step live in host memory instead of on the device.

- checkpoints: what a method keeps between forward and backward (layer inputs), copied out in forward and
  back in backward (`engine.offload`).
- optimizer: the optimizer's states and an fp32 master copy of every trainable parameter; each
  gradient goes to the host as soon as it is complete, the step runs there and the updated weights return
  (`engine.host_optimizer.HostAdamW`).
- params: the weights; each decoder layer's is gathered onto the device for its forward and again for its
  backward, one layer prefetched ahead, the embedding and the head when used (`engine.host_params`).

A set of tiers is written as one canonical string, the tiers in the order above joined by commas
("checkpoints,optimizer,params"), or "none". Pure Python: no torch, so bad input is refused at once.
"""

from __future__ import annotations

from itertools import combinations

OFFLOAD_TIERS = ("checkpoints", "optimizer", "params")
"""Every tier, in canonical order."""
OFFLOAD_MODES = ("none", *(",".join(c) for n in range(1, 4) for c in combinations(OFFLOAD_TIERS, n)))
"""Every canonical tier set: none, each tier alone, each pair, all three."""
ALL_TIERS = ",".join(OFFLOAD_TIERS)


class TierError(ValueError):
    """A tier set that is not one (the caller turns it into its own error type)."""


def canonical_offload(value: str | tuple[str, ...] | list[str] | frozenset[str] | set[str]) -> str:
    """The canonical string of a tier set given as a comma list or a collection of tier names.

    "none" (or nothing) is the empty set; "all" every tier. Unknown names raise TierError naming them."""
    names = value.split(",") if isinstance(value, str) else list(value)
    names = [str(name).strip().lower() for name in names if str(name).strip()]
    if names in ([], ["none"]):
        return "none"
    if names == ["all"]:
        return ALL_TIERS
    unknown = [name for name in names if name not in OFFLOAD_TIERS]
    if unknown:
        raise TierError(f"offload must be one of none, {', '.join(OFFLOAD_TIERS)}, all or a comma list of "
                        f"tiers; unknown tier {', '.join(map(repr, unknown))}")
    return ",".join(tier for tier in OFFLOAD_TIERS if tier in names)


def offload_tiers(value: str) -> tuple[str, ...]:
    """The tiers of a canonical tier string ("none" -> ())."""
    return () if value == "none" else tuple(value.split(","))


def tier_problem(method: str, offload: str, optimizer: str | None = None) -> str | None:
    """Why `method` cannot run with the canonical tier set `offload` (and `optimizer`, when known), in
    one line; None when it can.

    plain keeps no checkpoints and cannot stream layers (autograd holds every layer's weights from forward
    to backward), so it takes the optimizer tier only. With an optimizer, params needs optimizer: the
    weights the step updates live on the host, so the step runs there. The optimizer tier needs an
    optimizer to offload."""
    tiers = offload_tiers(offload)
    if method == "plain" and tiers == ("checkpoints",):
        return "offload does not apply to plain: it keeps no checkpoints, so there is nothing to offload"
    if method == "plain" and ("checkpoints" in tiers or "params" in tiers):
        refused = [tier for tier in tiers if tier != "optimizer"]
        return (f"offload {','.join(refused)} does not apply to plain: it keeps no checkpoints and cannot "
                "stream layers (autograd holds every layer's weights from forward to backward); use "
                "checkpoint, mst or streambp, or offload optimizer only")
    if optimizer == "none" and "optimizer" in tiers:
        return "offload optimizer needs an optimizer (optimizer adamw): a backprop-only step has none"
    if optimizer not in (None, "none") and "params" in tiers and "optimizer" not in tiers:
        return ("offload params with an optimizer needs optimizer too: the weights the step updates live "
                "on the host, so the step runs there (offload optimizer,params)")
    return None


def tier_label(offload: str) -> str:
    """How a table names a tier set after the method: '' (none), '+ offload' (checkpoints, the label
    rows had before the other tiers existed), else '+ offload <tiers>'."""
    if offload == "none":
        return ""
    return "+ offload" if offload == "checkpoints" else f"+ offload {offload}"
