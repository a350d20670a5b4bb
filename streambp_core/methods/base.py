"""The one interface every method implements: `prepare(model, ...)` -> Run; `run.loss(...)` -> scalar
loss with grad_fn; `run.close()` leaves the model as it was."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError, StreamConfig
from streambp_core.dtypes import at_least_float32
from streambp_core.engine.engines.deepspeed_tiers import check_deepspeed_tiers
from streambp_core.engine.engines.fsdp_unit import is_sharded
from streambp_core.engine.engines.reduction import (
    check_experts,
    full_shape,
    is_zero3,
    one_reduction_for,
    through_engine,
    zero_stage_of,
)
from streambp_core.engine.engines.zero3 import Zero3Units
from streambp_core.engine.host.params import HostParams
from streambp_core.engine.host.unit_grads import UnitGrads
from streambp_core.engine.packing import PackedRows, document_labels, packed_rows
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.engine.stream.objectives import default_labels
from streambp_core.engine.stream.router import RouterAux, aux_loss, router_aux, routing_sums
from streambp_core.methods import guards, hook_guards, sequence
from streambp_core.methods.objective_inputs import build_objective
from streambp_core.methods.sequence import StepShard
from streambp_core.models.adapters import DecoderParts
from streambp_core.models.precision import (
    eager_in_at_least_float32,
    islands_in_at_least_float32,
    restore_forwards,
)
from streambp_core.registry import Method


class Run(Method):
    """A model prepared for one method. Each method's run class extends its method's class
    (`registry`: `method`, `drives_modules`, `partitioned`, ...) and implements `_loss`.

    Use as a context manager, or call `close()`, to undo whatever `prepare` changed on the model.
    """

    def __init__(self, model: nn.Module, config: StreamConfig, sequence_group: SequenceGroup | None = None,
                 engine: nn.Module | None = None) -> None:
        """`config` is validated (`prepare` checks it against the method); `sequence_group`: the ranks that
        share each sequence (`methods.sequence`), None for none; `engine`: the DeepSpeed engine wrapping
        `model`, whose forward each loss then runs as (`engine.engines.reduction.through_engine`)."""
        if engine is None and is_zero3(model):
            raise ConfigError("under deepspeed zero3, prepare the engine itself (prepare(engine, ...)), not "
                              "engine.module: ZeRO-3 counts micro-steps in the engine's forward, and a loss "
                              "computed outside it would overwrite the accumulated gradients")
        self.model = model
        self.engine = engine
        """The DeepSpeed engine wrapping `model` (None without one)."""
        self.config = config
        self.sequence_group = sequence_group
        self._step_shard: StepShard | None = None
        """This step's shard under sequence parallelism (set by `loss`), else None."""
        self.objective_name = config.objective
        self.parts: DecoderParts = guards.parts_of(model)
        if self.drives_modules:
            guards.refuse_prompt_learning(model, self.method)
        self._check_dropout()
        hook_guards.refuse_hooks(self.method, model, self._hook_scopes())
        guards.claim(self.parts, self)
        self.router_aux: RouterAux | None = router_aux(self.parts.backbone.config)
        """The router load-balancing loss's settings when the model adds it to its loss, else None."""
        self._closed = False
        self.host_params: HostParams | None = None
        """The params tier's weights in host memory (None without it)."""
        self._reduction = None if self.drives_modules else one_reduction_for(model, self.method)
        """Under DeepSpeed ZeRO-1/2, one reduction per parameter per backward for a method that calls
        transformers' modules (`parallel.deepspeed`)."""
        self.zero3: Zero3Units | None = None
        """Under DeepSpeed ZeRO, the units of a method that drives the modules: gathered once each way
        (ZeRO-3), each parameter handed to ZeRO once as its unit's backward ends (`engine.engines.zero3`)."""
        self.host_grads: UnitGrads | None = None
        """With the optimizer tier, the units whose backward adds to a parameter's gradient chunk by chunk,
        each handing its gradients to the host once, as its backward ends (`engine.host.unit_grads`)."""
        self._host_optimizers: list = []
        """The `HostAdamW`s `adamw()` gave, whose gradient hooks `close()` takes off."""
        try:
            dtype = self.parts.embed.weight.dtype
            self._widened = islands_in_at_least_float32(model, dtype)
            """A float64 model's float32 islands (norms, routers, a hybrid's linear attention), widened while
            the run is open (`precision`)."""
            self._wide_eager = dtype == torch.float64 and eager_in_at_least_float32(self.parts.backbone, None)
            """Whether a float64 model's eager attention (its softmax in float32, NaN for a query that sees
            no key) attends as `precision.WIDE_EAGER` while the run is open, for every method."""
            self._kv_copies = 1
            """Copies of each KV head so they split over the sequence group (`methods.sequence`)."""
            if sequence_group is not None:
                self._kv_copies = sequence.check_sequence_run(self, sequence_group)
            self._setup()
            stage = zero_stage_of(model)
            if stage is not None:  # DeepSpeed's offload sections hold the optimizer and params tiers
                check_deepspeed_tiers(self.method, config.offload, stage, engine)
            elif config.offload.params:
                self.host_params = self._host_params(next(model.parameters()).device)
            if is_zero3(model):
                check_experts(self.parts.layers, self.method, self.drives_modules)
            if self.drives_modules and stage is not None:
                self.zero3 = self._zero3_units()
            if config.offload.optimizer and self.zero3 is None \
                    and not any(is_sharded(layer) for layer in self.parts.layers):
                self.host_grads = self._host_grads()
        except BaseException:
            self._narrow()
            guards.release(self.parts, self)
            raise

    @property
    def closed(self) -> bool:
        """Whether `close()` has run (the model is plain again)."""
        return self._closed

    def loss(
        self,
        input_ids: Tensor,
        attention_mask: Tensor | None = None,
        labels: Tensor | None = None,
        position_ids: Tensor | None = None,
        **objective_inputs: Any,
    ) -> Tensor:
        """Scalar training loss of one batch; `loss.backward()` fills the model's `.grad`.

        input_ids (B, T); attention_mask (B, T) with 1 for real tokens (None: all real); labels (B, T)
        with -100 for ignored positions (None: the inputs, padding ignored); position_ids (B, T) or (1, T)
        that restart at 0 for each document of a packed row (None: 0..T-1; see `engine.packing`).
        Under sequence parallelism every rank passes the whole batch and gets the whole sequence's loss;
        its backward leaves its own shard's share of the gradients (`methods.sequence`).
        """
        if self._closed:
            raise RuntimeError(f"this {self.method} run was closed; prepare the model again")
        _check_batch(input_ids, attention_mask, labels)
        guards.check_tokens(input_ids, full_shape(self.parts.embed.weight)[0])
        if labels is not None:
            guards.check_labels(labels, full_shape(self.parts.lm_head.weight)[0])
        if self.sequence_group is not None:
            self._step_shard = sequence.step_shard(self.sequence_group, self._kv_copies, input_ids,
                                                   key_padding(attention_mask), position_ids)
        packed = self.packed_rows(input_ids, attention_mask, position_ids)
        if labels is None and packed is not None:
            labels = document_labels(input_ids, packed)
        if labels is None:
            labels = default_labels(input_ids, attention_mask)
        if self.objective_name == "sft":
            guards.check_sft_targets(labels)
        self._input_ids = input_ids
        if self._step_shard is not None:
            start, end = self._step_shard.bounds
            input_ids = input_ids[:, start:end]
        if self.engine is None:
            loss = self._loss(input_ids, attention_mask, labels, packed=packed, **objective_inputs)
        else:
            loss = through_engine(self.engine, lambda: self._loss(input_ids, attention_mask, labels,
                                                                  packed=packed, **objective_inputs))
        loss = guards.watch_versions(loss, self.model)
        return loss if self._reduction is None else self._reduction.arm(loss)

    def shard_batch(self, input_ids: Tensor, attention_mask: Tensor | None = None,
                    position_ids: Tensor | None = None) -> tuple[int, int]:
        """Under sequence parallelism, set this rank's shard of the whole batch `input_ids` (B, T) for the
        forward that follows, as `loss` sets it, and return its (start, end) positions: for a decoder stack
        that a trainer calls itself (`integrations.sequence_trainer`)."""
        if self.sequence_group is None:
            raise ConfigError(f"this {self.method} run has no sequence group to shard a batch over")
        self._step_shard = sequence.step_shard(self.sequence_group, self._kv_copies, input_ids,
                                               key_padding(attention_mask), position_ids)
        self._input_ids = input_ids
        return self._step_shard.bounds

    def packed_rows(self, input_ids: Tensor, attention_mask: Tensor | None,
                    position_ids: Tensor | None) -> PackedRows | None:
        """The documents of packed rows (`engine.packing.packed_rows`); None for ordinary rows.
        ConfigError for position_ids that cannot be, for a model that cannot keep a row's documents apart
        (`guards.check_packing`), and for an objective other than sft (GRPO and DPO score whole sequences,
        and TRL's trainers for them do not pack)."""
        packed = packed_rows(position_ids, attention_mask, tuple(input_ids.shape))
        if packed is not None:
            guards.check_packing(self.parts)
        if packed is not None and self.objective_name != "sft":
            raise ConfigError(f"packed rows (position_ids restarting per document) cannot train the "
                              f"{self.objective_name} objective: it scores whole sequences; pack for sft")
        return packed

    def make_objective(self, labels: Tensor, **objective_inputs: Any):
        """The streamed objective for this batch (see `streambp_core.engine.stream.objectives`); under
        sequence parallelism the whole batch's, as this rank's shard computes it
        (`sequence.ShardObjective`)."""
        objective = build_objective(self.objective_name, self._input_ids, labels, **objective_inputs)
        if self._step_shard is None:
            return objective
        return sequence.ShardObjective(objective, self._step_shard.bounds[0], self.sequence_group)

    def router_loss(self, router_logits: tuple[Tensor, ...], attention_mask: Tensor | None) -> Tensor | float:
        """`router_aux_loss_coef` times the load-balancing loss of every routed layer's router logits
        (B * T, E), as transformers adds it to a causal LM's loss; 0 when the model does not add it."""
        if self.router_aux is None or not router_logits:
            return 0.0
        rows = None if attention_mask is None else attention_mask.reshape(-1).bool()
        sums = [routing_sums(logits, rows, self.router_aux) for logits in router_logits]
        valid_tokens = router_logits[0].shape[0] if rows is None else rows.sum()
        return aux_loss([s[0] for s in sums], [s[1] for s in sums], valid_tokens, self.router_aux)

    def close(self) -> None:
        """Undo what preparing changed; the model is plain again."""
        if not self._closed:
            try:
                if self.host_params is not None:
                    self.host_params.close()
                if self.zero3 is not None:
                    self.zero3.close()
                if self.host_grads is not None:
                    self.host_grads.close()
                for optimizer in self._host_optimizers:  # else they take a later run's gradients
                    optimizer.remove_hooks()
                self._teardown()
                if self._reduction is not None:
                    self._reduction.disarm()
            finally:
                self._closed = True
                self._narrow()
                guards.release(self.parts, self)

    def _narrow(self) -> None:
        """Give back the float32 islands and the eager attention the run widened."""
        restore_forwards(getattr(self, "_widened", []))
        if getattr(self, "_wide_eager", False):
            self.parts.backbone.set_attn_implementation("eager")

    def __enter__(self) -> Run:
        return self

    def __exit__(self, *exc_info) -> None:
        self.close()

    def adamw(self, *, lr: float = 1e-5, **options) -> torch.optim.Optimizer:
        """AdamW over the model's trainable parameters: in host memory (`HostAdamW`) with the optimizer
        tier, else torch's on the device. Options as torch.optim.AdamW's (lr, betas, eps, weight_decay).
        `close()` takes a host optimizer's gradient hooks off (its later steps apply `.grad` as it is)."""
        from streambp_core.engine.host.optimizer import HostAdamW, adamw

        if self._closed:
            raise RuntimeError(f"this {self.method} run was closed; prepare the model again")
        optimizer = adamw(self.model, self.config.offload.optimizer, lr=lr, **options)
        if isinstance(optimizer, HostAdamW):
            self._host_optimizers.append(optimizer)
        return optimizer

    def _host_params(self, device) -> HostParams:
        """The params tier for this method: units bracketed by module hooks (`host_tier.hooked_params`)."""
        from streambp_core.methods.host_tier import hooked_params

        return hooked_params(self.parts, device)

    def unit_brackets(self) -> list:
        """The brackets a method that drives its units enters each unit's input through, in this order
        (the params tier's first, so a unit hands its gradients over while it is still gathered)."""
        return [b for b in (self.host_params, self.host_grads, self.zero3) if b is not None]

    def _host_grads(self) -> UnitGrads | None:
        """The optimizer tier's units that hand their gradients over once (`engine.host.unit_grads`); None for
        a method whose backward fires each parameter's gradient once already (plain, checkpoint)."""
        return None

    def _zero3_units(self) -> Zero3Units:
        """The units this method gathers under DeepSpeed ZeRO-3 (methods that drive the modules)."""
        raise ConfigError(f"{self.method} under deepspeed zero3 is not supported")

    def _check_dropout(self) -> None:
        """ConfigError when dropout is on where this method cannot replay it (see `guards`)."""

    def _hook_scopes(self) -> list[hook_guards.HookScope]:
        """Where this method cannot run a user's hooks as plain does (`hook_guards`); none here."""
        return []

    def _setup(self) -> None:
        """Change the model for this method (reversibly)."""

    def _teardown(self) -> None:
        """Undo `_setup`."""

    def _loss(self, input_ids, attention_mask, labels, packed: PackedRows | None = None,
              **objective_inputs) -> Tensor:
        raise NotImplementedError


def key_padding(attention_mask: Tensor | None) -> Tensor | None:
    """(B, T) bool of real tokens, or None when there is no padding (one device sync per step)."""
    if attention_mask is None:
        return None
    valid = attention_mask.bool()
    if valid.device.type != "meta" and bool(valid.all()):
        return None
    return valid


def _check_batch(input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor | None) -> None:
    if input_ids.dim() != 2:
        raise ConfigError(f"input_ids must be (batch, seq_len), got shape {tuple(input_ids.shape)}")
    if input_ids.shape[1] < 2:
        raise ConfigError("seq_len must be at least 2 (a causal LM predicts the next token)")
    for name, other in (("attention_mask", attention_mask), ("labels", labels)):
        if other is not None and other.shape != input_ids.shape:
            shapes = f"{tuple(other.shape)} != input_ids shape {tuple(input_ids.shape)}"
            raise ConfigError(f"{name} shape {shapes}")


def full_logits_loss(run: Run, logits: Tensor, labels: Tensor, **objective_inputs: Any) -> Tensor:
    """Loss of an objective from full (B, T, V) logits, for methods that materialise them."""
    objective = run.make_objective(labels, **objective_inputs)
    terms = objective.token_terms(logits.to(objective.logits_dtype(logits.dtype)), 0, logits.shape[1])
    stats_dtype = at_least_float32(logits.dtype)
    return objective.reduce(terms.sum(dim=1).to(stats_dtype))
