"""What the own-layer stream (`engine.own.layer`) does not carry in a model's decoder layers themselves,
whatever the run's setting, named in one line: `methods.own_stream` refuses it when a run is prepared, and
`methods.guards.family_refusals` names it before a step (what `verify --method all` leaves out)."""

from __future__ import annotations

from streambp_core.registry import methods_where


def refusal_message(family: str, cause: str) -> str:
    """streambp's one-line refusal of `family` on the own-layer path, naming `cause` and what runs it."""
    return (f"streambp: architecture {family!r} runs through its own decoder layers, which do not carry "
            f"{cause}; {', '.join(methods_where(drives_modules=False))} run it")


def layers_refusal(layers) -> str | None:
    """What of the decoder layers themselves the own-layer path does not carry, in a clause, whatever the
    run's setting (`methods.guards.family_refusals` names it before a step); None when it carries them."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    other = next((layer for layer in layers if not isinstance(layer, GradientCheckpointingLayer)), None)
    if other is not None:
        return f"a layer that is no transformers GradientCheckpointingLayer ({type(other).__name__})"
    return None
