"""The host tiers a prepared run holds: its weights in host memory (`params`) and the optimizer it offers
(`optimizer`); see `streambp_core.tiers`.

Units of the params tier, in forward order: the embedding (forward only: its backward scatters by
index and reads no weight), each decoder layer, then the head. Methods that call transformers' modules
(checkpoint, mst) have their units bracketed by module hooks; streambp brackets its streamed layers and
head itself, so the head is one unit (final norm and lm_head, which its streamed head runs together).

Units of the optimizer tier's hand-over (`engine.host.unit_grads`), where a backward adds to a gradient chunk
by chunk, are the ones each method gathers under ZeRO-3 (`MstRun._tiled_units`: its tiled MLP blocks and
lm_head; `StreamBPRun._streamed_units`: its streamed layers and head, numbered as its params tier's). A
tied embedding's weight is shared: the embedding's own accumulation, last in backward, sends it.
"""

from __future__ import annotations

import torch

from streambp_core.engine.host.params import HostParams
from streambp_core.models.adapters import DecoderParts


def hooked_params(parts: DecoderParts, device: torch.device, *, hook_head: bool = True) -> HostParams:
    """Weights on the host, units [embedding, each layer, final norm, lm_head], each bracketed by its
    module's hooks (lm_head not when `hook_head` is False: the method brackets it, unit `len(layers)+2`)."""
    units = [[parts.embed], *([layer] for layer in parts.layers), [parts.norm], [parts.lm_head]]
    tier = HostParams(units, device, forward_only=(0,))
    for index, (module,) in enumerate(units):
        if hook_head or module is not parts.lm_head:
            tier.hook(index, module)
    return tier


def streamed_params(parts: DecoderParts, device: torch.device) -> HostParams:
    """Weights on the host, units [embedding, each layer, head (final norm + lm_head)]; the embedding is
    bracketed by its hooks, layers and head by the streamed method (`HostParams.enter`, `leave`)."""
    units = [[parts.embed], *([layer] for layer in parts.layers), [parts.norm, parts.lm_head]]
    tier = HostParams(units, device, forward_only=(0,))
    tier.hook(0, parts.embed)
    return tier
