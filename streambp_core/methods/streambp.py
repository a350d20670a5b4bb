"""streambp: every decoder layer and the LM head streamed along the sequence (arXiv 2506.03077).

The model itself is not changed: `loss` drives its modules through the engine's autograd functions —
embedding, then one `StreamedLayer` per decoder layer, then the `StreamedHead` (final norm, lm_head and
objective). Only each layer's input is kept between forward and backward; with `offload="checkpoints"`
in host memory, one `engine.offload.HostChain` per step (each layer's input and the head's hidden state).
On a model sharded with `streambp_core.dist.shard_model`, the step and each layer run as their FSDP unit's
forward, so a layer's parameters are gathered once for all its chunks and its gradients reduce-scattered
once after the last.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from streambp_core.dist.fsdp import sharded_forward
from streambp_core.engine.chunks import trainable_parameters
from streambp_core.engine.head import FusedHead, HeadPlan, StreamedHead, head_mode
from streambp_core.engine.layer import LayerPlan, StreamedLayer
from streambp_core.engine.offload import HostChain
from streambp_core.engine.router import aux_loss
from streambp_core.measure.tags import memory_category
from streambp_core.methods import guards
from streambp_core.methods.base import Run, key_padding
from streambp_core.models.adapters import layer_parts


class StreamBPRun(Run):
    """Exact backpropagation with one chunk's activations alive per layer."""

    method = "streambp"
    drives_modules = True

    def _check_dropout(self) -> None:
        recomputed = [*self.parts.layers, self.parts.norm, self.parts.lm_head]
        guards.refuse_dropout(self.method, guards.active_dropout(recomputed),
                              "its chunked recompute does not replay the forward's random masks")

    def _setup(self) -> None:
        cfg = self.config
        self._layers = [
            (layer, LayerPlan(layer_parts(layer), cfg.partition_size, cfg.attn, reuse_grad_out=True,
                              keep_chunks=cfg.keep_chunks, router_aux=self.router_aux))
            for layer in self.parts.layers
        ]
        self._head = HeadPlan(self.parts.norm, self.parts.lm_head, cfg.head_partition_size, cfg.keep_chunks)
        fused = head_mode(cfg.head_mode, self.objective_name) == "fused"
        self._head_function = FusedHead if fused else StreamedHead

    def _loss(self, input_ids, attention_mask, labels, **objective_inputs):
        objective = self.make_objective(labels, **objective_inputs)
        return sharded_forward(self.model, partial(self._streamed_loss, objective), input_ids, attention_mask)

    def _streamed_loss(self, objective, input_ids, attention_mask):
        chain = self._host_chain(input_ids)
        hidden, routing = self._streamed_layers(input_ids, attention_mask, chain)
        head_params = trainable_parameters([self.parts.norm, self.parts.lm_head])
        loss = self._head_function.apply(hidden, objective, _offloaded(self._head, chain), *head_params)
        if not routing:
            return loss
        valid = key_padding(attention_mask)
        valid_tokens = input_ids.numel() if valid is None else valid.sum()
        prob_sums, picks = zip(*routing, strict=True)
        return loss + aux_loss(list(prob_sums), list(picks), valid_tokens, self.router_aux)

    def hidden_states(self, input_ids, attention_mask=None):
        """The last decoder layer's output (B, T, d), before the final norm, through the streamed layers.

        `loss` puts the streamed head on top; a trainer's own head (e.g. a fused log-prob head) can too.
        The router load-balancing loss, when the model enables it, is added by `loss` only.
        On a sharded model, call it inside the model's FSDP forward (`sharded_forward`), as `loss` does.
        """
        return self._streamed_layers(input_ids, attention_mask, self._host_chain(input_ids))[0]

    def _host_chain(self, input_ids) -> HostChain | None:
        """This step's host chain when offloading checkpoints, else None."""
        return HostChain(input_ids.device) if self.config.offload == "checkpoints" else None

    def _streamed_layers(self, input_ids, attention_mask, chain: HostChain | None):
        """The last layer's output and the (probability sums, picks) of each routed layer under the
        load-balancing loss."""
        with memory_category("checkpoints"):
            hidden = self.parts.embed(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        rope = self.parts.rope_tables(hidden, positions)
        valid = key_padding(attention_mask)
        routing = []
        for layer, plan in self._layers:
            layer_step = partial(_streamed_layer, layer, _offloaded(plan, chain))
            hidden = sharded_forward(layer, layer_step, hidden, *rope[plan.parts.rope_key], valid)
            if isinstance(hidden, tuple):
                hidden, *sums = hidden
                routing.append(sums)
        return hidden, routing


def _streamed_layer(layer, plan: LayerPlan, hidden, cos, sin, valid):
    """One decoder layer through `StreamedLayer`, with the parameters the layer holds now (gathered ones
    when it is a sharded unit)."""
    return StreamedLayer.apply(hidden, cos, sin, valid, plan, *trainable_parameters([layer]))


def _offloaded(plan, chain: HostChain | None):
    """`plan` keeping its saved input in this step's host chain (the plan itself when not offloading)."""
    return plan if chain is None else replace(plan, offload=chain)
