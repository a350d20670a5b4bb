"""mst: Mini-Sequence Transformer — activation checkpointing, the MLP in sequence chunks, and a chunked
LM head and loss that recompute logits in backward (arXiv 2407.15892)."""

from __future__ import annotations

import functools
from functools import partial

from torch import nn

from streambp_core.config import ConfigError
from streambp_core.engine.chunks import trainable_parameters
from streambp_core.engine.engines.fsdp_unit import sharded_forward
from streambp_core.engine.engines.zero3 import Zero3Units
from streambp_core.engine.host.unit_grads import UnitGrads
from streambp_core.engine.stream.head import HeadPlan, StreamedHead
from streambp_core.engine.stream.mlp import chunk_mlp, unchunk_mlp
from streambp_core.methods import guards
from streambp_core.methods.checkpoint import CheckpointRun
from streambp_core.methods.hook_guards import PARAM_HOOKS, HookScope, above
from streambp_core.models.adapters import layer_mlp, layer_parts
from streambp_core.models.catalogue import serving
from streambp_core.models.generic import mst_pieces, returns_pair
from streambp_core.registry import Mst


class MstRun(Mst, CheckpointRun):
    """Checkpointed layers with chunked MLPs; the head never materialises T x vocab logits."""


    @functools.cached_property
    def _mlps(self) -> tuple[tuple[nn.Module, bool], ...]:
        """(MLP, whether it returns (hidden states, router scores)) of each decoder layer: the family's
        (`adapters.layer_mlp`), or of a baselines family found generically (`models.generic.mst_pieces`:
        ConfigError naming the piece it lacks)."""
        if serving(self.parts.family).path != "baselines":
            return tuple((layer_mlp(layer), layer_parts(layer).mlp_pair) for layer in self.parts.layers)
        model = self.model
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        return tuple((mlp, returns_pair(mlp)) for mlp in mst_pieces(base, self.parts.layers).mlps)

    def _check_dropout(self) -> None:
        super()._check_dropout()
        recomputed = [*(mlp for mlp, _ in self._mlps), self.parts.lm_head]
        guards.refuse_dropout(self.method, guards.active_dropout(recomputed),
                              "its chunked MLP and LM head recompute without replaying the forward's masks")

    def _hook_scopes(self) -> list[HookScope]:
        """Checkpoint's, the modules above the decoder stack (whose forward mst never calls), and each MLP
        and the LM head (run chunk by chunk; the head's parameters' gradients written into `.grad`)."""
        chunked = "it runs each MLP and the LM head chunk by chunk"
        mlps = tuple(mlp for mlp, _ in self._mlps)
        return [*super()._hook_scopes(),
                HookScope(above(self.model, [self.parts.backbone, self.parts.lm_head]),
                          "it never calls the model's own forward", subtree=False),
                HookScope(mlps, chunked, param_kinds=tuple(PARAM_HOOKS)),
                HookScope((self.parts.lm_head,), chunked, param_kinds=("_backward_hooks",))]

    def _setup(self) -> None:
        if self.router_aux is not None:
            raise ConfigError("mst: the router load-balancing loss (output_router_logits) is not supported: "
                              "a chunked MLP's router logits carry no gradient")
        super()._setup()
        for mlp, pair in self._mlps:
            chunk_mlp(mlp, self.config.mlp_chunk_tokens, self.config.keep_chunks, pair=pair)

    def _teardown(self) -> None:
        for mlp, _ in self._mlps:
            unchunk_mlp(mlp)
        super()._teardown()

    def _loss(self, input_ids, attention_mask, labels, packed=None, **objective_inputs):
        objective = self.make_objective(labels, **objective_inputs)
        loss = partial(self._chunked_loss, objective, packed)
        return sharded_forward(self.model, loss, input_ids, attention_mask)

    def _chunked_loss(self, objective, packed, input_ids, attention_mask):
        """Backbone, then the chunked head; run as the model's forward when the model is sharded."""
        inputs = self.model_inputs(attention_mask, packed)
        outputs = self.parts.backbone(input_ids=input_ids, **inputs, use_cache=False)
        hidden = outputs.last_hidden_state
        plan = HeadPlan(norm=None, lm_head=self.parts.lm_head, partition_size=self.config.head_partition_size,
                        keep_chunks=self.config.keep_chunks, logits_scaling=self.parts.logits_scaling,
                        final_softcap=self.parts.final_softcap)
        params = trainable_parameters([self.parts.lm_head])
        brackets = self.unit_brackets()  # lm_head is each one's last unit; its chunks run inside the head
        for bracket in brackets:
            hidden = bracket.enter(bracket.num_units - 1, hidden)
        loss = StreamedHead.apply(hidden, objective, plan, *params)
        for bracket in brackets:
            loss = bracket.leave(bracket.num_units - 1, loss)
        return loss

    def _tiled_units(self, kind):
        """mst's units as `kind` (`Zero3Units`, `UnitGrads`): each layer's chunked MLP (bracketed by its
        module hooks), then lm_head (bracketed around the chunked head; a tied one is shared)."""
        mlps = [mlp for mlp, _ in self._mlps]
        units = kind([*([mlp] for mlp in mlps), [self.parts.lm_head]], shared=self.parts.embed.parameters())
        for index, mlp in enumerate(mlps):
            units.hook(index, mlp)
        return units

    def _zero3_units(self) -> Zero3Units:
        """Units under DeepSpeed ZeRO-3 (`_tiled_units`; the rest of each layer runs under DeepSpeed's own
        hooks)."""
        return self._tiled_units(Zero3Units)

    def _host_params(self, device):
        """The params tier: lm_head bracketed around the chunked head, the rest by module hooks."""
        from streambp_core.methods.host_tier import hooked_params

        return hooked_params(self.parts, device, hook_head=False)

    def _host_grads(self) -> UnitGrads:
        """The optimizer tier's hand-over: each tiled MLP block and lm_head (`_tiled_units`)."""
        return self._tiled_units(UnitGrads)
