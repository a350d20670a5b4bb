"""streambp: every decoder layer and the LM head streamed along the sequence (arXiv 2506.03077).

The model itself is not changed: `loss` drives its modules through the engine's autograd functions —
embedding, then one `StreamedLayer` per decoder layer, then the `StreamedHead` (final norm, lm_head and
objective). Only each layer's input is kept between forward and backward; with `offload="checkpoints"`
in host memory, one `engine.host.checkpoints.HostChain` per step (each layer's input and the head's hidden
state).
On a model sharded with `streambp_core.parallel.shard_model`, the step and each layer run as their FSDP unit's
forward, so a layer's parameters are gathered once for all its chunks and its gradients reduce-scattered
once after the last.
"""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import torch

from streambp_core.config import ConfigError
from streambp_core.engine.chunks import trainable_parameters
from streambp_core.engine.engines.fsdp_unit import sharded_forward
from streambp_core.engine.engines.zero3 import Zero3Units
from streambp_core.engine.host.checkpoints import HostChain
from streambp_core.engine.host.unit_grads import UnitGrads
from streambp_core.engine.sequence.layer import SEQUENCE_STEPS, SequenceShard, SequenceStreamedLayer
from streambp_core.engine.sequence.mla import MLA_SEQUENCE_STEPS
from streambp_core.engine.stream.delta import DeltaStreamedLayer
from streambp_core.engine.stream.head import FusedHead, HeadPlan, StreamedHead
from streambp_core.engine.stream.layer import STREAMED, LayerPlan, StreamedLayer
from streambp_core.engine.stream.mla import MLA_STEPS
from streambp_core.engine.stream.router import aux_loss
from streambp_core.measure.tags import memory_category
from streambp_core.methods import guards
from streambp_core.methods.base import Run, key_padding
from streambp_core.methods.hook_guards import HookScope, above
from streambp_core.methods.own_stream import OwnStream, refuse_packed
from streambp_core.models.adapters import layer_parts
from streambp_core.models.catalogue import serving
from streambp_core.registry import StreamBP


class StreamBPRun(StreamBP, Run):
    """Exact backpropagation with one chunk's activations alive per layer."""

    _own: OwnStream | None = None
    """A family of the baselines tier streamed through its own decoder layers (`methods.own_stream`)."""

    def _check_dropout(self) -> None:
        recomputed = [*self.parts.layers, self.parts.norm, self.parts.lm_head]
        guards.refuse_dropout(self.method, guards.active_dropout(recomputed),
                              "its chunked recompute does not replay the forward's random masks")

    def _hook_scopes(self) -> list[HookScope]:
        """Every module but the embedding: their forwards never run (the layers, final norm and LM head run
        through the engine's autograd functions, which write their parameters' gradients into `.grad`)."""
        return [HookScope(above(self.model, [self.parts.embed]), "it runs the decoder layers, the final norm "
                          "and the LM head chunk by chunk through its own autograd functions, never through "
                          "their forward, and writes their gradients into .grad itself", subtree=False,
                          param_kinds=("_backward_hooks",))]

    def _setup(self) -> None:
        if serving(self.parts.family).path == "baselines":
            self._own = OwnStream(self)
            return
        cfg = self.config
        if self.router_aux is not None and any(layer_parts(layer).delta for layer in self.parts.layers):
            raise ConfigError("streambp: the router load-balancing loss (output_router_logits) is not "
                              "supported with Gated DeltaNet layers (Qwen3.5-MoE): their chunked layer "
                              "returns no routing sums")
        self._layers = [
            (layer, LayerPlan(layer_parts(layer), cfg.partition_size, cfg.attn, reuse_grad_out=True,
                              keep_chunks=cfg.keep_chunks, router_aux=self.router_aux,
                              attn_blocking=cfg.attn_blocking))
            for layer in self.parts.layers
        ]
        self._head = HeadPlan(self.parts.norm, self.parts.lm_head, cfg.head_partition_size, cfg.keep_chunks,
                              logits_scaling=self.parts.logits_scaling,
                              final_softcap=self.parts.final_softcap)
        fused = cfg.head_mode == "fused"  # resolved against the objective by StreamConfig
        self._head_function = FusedHead if fused else StreamedHead

    def _teardown(self) -> None:
        if self._own is not None:
            self._own.close()

    def _loss(self, input_ids, attention_mask, labels, packed=None, **objective_inputs):
        if self._own is not None:
            refuse_packed(packed)
            return self._own.loss(input_ids, attention_mask, labels, **objective_inputs)
        guards.check_eager_padding(self.parts.backbone.config, attention_mask, self.method)
        objective = self.make_objective(labels, **objective_inputs)
        loss = partial(self._streamed_loss, objective, packed)
        return sharded_forward(self.model, loss, input_ids, attention_mask)

    def _streamed_loss(self, objective, packed, input_ids, attention_mask):
        chain = self._host_chain(input_ids)
        hidden, routing = self._streamed_layers(input_ids, attention_mask, chain, packed)
        head = len(self._layers) + 1  # the head's unit of the params tier
        hidden = self._enter(head, hidden)
        head_params = trainable_parameters([self.parts.norm, self.parts.lm_head])
        loss = self._leave(head, self._head_function.apply(hidden, objective, _offloaded(self._head, chain),
                                                           *head_params))
        if not routing:
            return loss
        valid = key_padding(attention_mask)
        valid_tokens = input_ids.numel() if valid is None else valid.sum()
        prob_sums, picks = zip(*routing, strict=True)
        return loss + aux_loss(list(prob_sums), list(picks), valid_tokens, self.router_aux)

    def hidden_states(self, input_ids, attention_mask=None, position_ids=None):
        """The last decoder layer's output (B, T, d), before the final norm, through the streamed layers.

        `loss` puts the streamed head on top; a trainer's own head (e.g. a fused log-prob head) can too.
        The router load-balancing loss, when the model enables it, is added by `loss` only.
        On a sharded model, call it inside the model's FSDP forward (`sharded_forward`), as `loss` does.
        `position_ids` that restart per document make packed rows (`engine.packing`). Under sequence
        parallelism `input_ids` is the whole batch given to `shard_batch`, and the output this rank's shard.
        """
        shard = self._step_shard
        if self.sequence_group is not None:  # the whole batch, after `shard_batch` set this rank's shard
            if shard is None or getattr(self, "_input_ids", None) is not input_ids:
                raise ConfigError("hidden_states under sequence parallelism: call shard_batch with the whole "
                                  "batch first (or use loss); each rank computes its shard of it")
            input_ids = input_ids[:, shard.bounds[0]:shard.bounds[1]]
        if self._own is not None:
            raise ConfigError(f"hidden_states: architecture {self.parts.family!r} streams through its own "
                              "decoder layers, whose stack applies its final norm; use loss")
        guards.check_eager_padding(self.parts.backbone.config, attention_mask, self.method)
        packed = self.packed_rows(input_ids, attention_mask, position_ids)
        return self._streamed_layers(input_ids, attention_mask, self._host_chain(input_ids), packed)[0]

    def _host_chain(self, input_ids) -> HostChain | None:
        """This step's host chain when offloading checkpoints, else None."""
        return HostChain(input_ids.device) if self.config.offload.checkpoints else None

    def _streamed_layers(self, input_ids, attention_mask, chain: HostChain | None, packed=None):
        """The last layer's output and the (probability sums, picks) of each routed layer under the
        load-balancing loss. Packed rows: RoPE at their positions, attention within each document."""
        with memory_category("checkpoints"):
            hidden = self.parts.embed_tokens(input_ids)
        positions = torch.arange(input_ids.shape[1], device=input_ids.device)[None]
        if packed is not None:
            positions = packed.positions
        valid = key_padding(attention_mask)
        shard = self._step_shard
        if shard is not None:  # this rank's shard at its global positions; attention over every position
            positions, valid = shard.positions, shard.key_valid
        rope = self.parts.rope_tables(hidden, positions)
        routing = []
        for unit, (layer, plan) in enumerate(self._layers, start=1):
            plan = plan if packed is None else replace(plan, packed=packed)
            layer_step = partial(_streamed_layer, layer, _offloaded(plan, chain),
                                 None if shard is None else shard.shard)
            hidden = self._enter(unit, hidden)
            hidden = sharded_forward(layer, layer_step, hidden, *rope[plan.parts.rope_key], valid)
            if isinstance(hidden, tuple):
                hidden, *sums = hidden
                routing.append(sums)
            hidden = self._leave(unit, hidden)
        return hidden, routing

    def _host_params(self, device):
        """The params tier: layers and head bracketed here (`host_tier.streamed_params`)."""
        from streambp_core.methods.host_tier import streamed_params

        return streamed_params(self.parts, device)

    def _streamed_units(self, kind):
        """streambp's units as `kind` (`Zero3Units`, `UnitGrads`), numbered as the params tier's: [none (the
        embedding's gradient fires once; under ZeRO-3 it runs under DeepSpeed's own hooks), each layer,
        head (final norm + lm_head)], bracketed by the method; a tied head's weight is shared."""
        units = [[], *([layer] for layer in self.parts.layers), [self.parts.norm, self.parts.lm_head]]
        return kind(units, shared=self.parts.embed.parameters())

    def _zero3_units(self) -> Zero3Units:
        """Units under DeepSpeed ZeRO-3 (`_streamed_units`)."""
        return self._streamed_units(Zero3Units)

    def _host_grads(self) -> UnitGrads:
        """The optimizer tier's hand-over: each streamed layer and the head (`_streamed_units`)."""
        return self._streamed_units(UnitGrads)

    def _enter(self, unit: int, hidden):
        """`hidden` entering unit `unit` of each bracket (`Run.unit_brackets`; unchanged without)."""
        for bracket in self.unit_brackets():
            hidden = bracket.enter(unit, hidden)
        return hidden

    def _leave(self, unit: int, output):
        """`output` leaving unit `unit` of each bracket (`Run.unit_brackets`; unchanged without)."""
        for bracket in self.unit_brackets():
            output = bracket.leave(unit, output)
        return output


def _streamed_layer(layer, plan: LayerPlan, shard: SequenceShard | None, hidden, cos, sin, valid):
    """One decoder layer through `StreamedLayer` (`SequenceStreamedLayer` on a sequence-parallel shard),
    with the parameters the layer holds now (gathered ones when it is a sharded unit)."""
    params = trainable_parameters([layer])
    if shard is not None:
        steps = SEQUENCE_STEPS if plan.parts.mla is None else MLA_SEQUENCE_STEPS
        return SequenceStreamedLayer.apply(hidden, cos, sin, valid, plan, shard, steps, *params)
    if plan.parts.delta is not None:
        return DeltaStreamedLayer.apply(hidden, cos, sin, valid, plan, *params)
    steps = STREAMED if plan.parts.mla is None else MLA_STEPS
    return StreamedLayer.apply(hidden, cos, sin, valid, plan, steps, *params)


def _offloaded(plan, chain: HostChain | None):
    """`plan` keeping its saved input in this step's host chain (the plan itself when not offloading)."""
    return plan if chain is None else replace(plan, offload=chain)
