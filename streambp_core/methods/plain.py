"""plain: the model untouched; transformers' own forward, loss and backward. The reference.

A float64 model's loss is computed from its float64 logits (transformers' loss would cast them to float32).
With `baseline_loss="trl"` a GRPO or DPO loss is computed as TRL's trainers do (`methods.trl_loss`).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch

from streambp_core.engine.attention.hf import engine_attention, engine_mask_argument
from streambp_core.engine.own.layer import indexed
from streambp_core.engine.packing import PackedRows
from streambp_core.engine.sequence.hf import sequence_attention, sequence_mask_argument
from streambp_core.engine.stream.objectives import IGNORE_INDEX
from streambp_core.methods import guards, trl_loss
from streambp_core.methods.base import Run, full_logits_loss, key_padding
from streambp_core.models.adapters import layer_parts
from streambp_core.registry import Plain


def attends_beyond_the_kernel(layer) -> bool:
    """Whether `layer`'s attention is more than the engine kernel takes: a sparse-attention indexer's pick of
    each query's keys (DeepSeek-V3.2's and GLM-5's DSA, a (B, T, T) mask), or compressed keys appended to
    its own with their own causal bias (DeepSeek-V4's CSA and HCA blocks)."""
    attention = getattr(layer, "self_attn", None)
    return indexed(layer) or getattr(attention, "compressor", None) is not None


class PlainRun(Plain, Run):
    """Ordinary backpropagation: every activation of every layer and the full logits are kept."""


    def _check_dropout(self) -> None:
        if self.uses_engine_attention or self.sequence_group is not None:
            attention = (layer.self_attn for layer in self.parts.layers
                         if getattr(layer, "self_attn", None) is not None)
            guards.refuse_dropout(self.method, guards.attention_dropout(attention),
                                  "the engine's attention kernel has no dropout")

    def _setup(self) -> None:
        self._attention = ExitStack()
        if self.sequence_group is not None:
            parts = layer_parts(self.parts.layers[0])
            self._attention.enter_context(sequence_attention(
                self.model, [layer.self_attn for layer in self.parts.layers], self.sequence_group,
                parts.num_heads, parts.num_kv_heads, self.config.attn))
        elif self.uses_engine_attention:
            self._attention.enter_context(engine_attention(self.model, self.config.attn))

    def _teardown(self) -> None:
        self._attention.close()

    @property
    def uses_engine_attention(self) -> bool:
        """Whether the transformers layers attend through the engine kernel (see StreamConfig). Never where
        a layer's attention is more than the kernel takes (`attends_beyond_the_kernel`): those layers keep
        their own attention, on the meta device too."""
        if any(attends_beyond_the_kernel(layer) for layer in self.parts.layers):
            return False
        choice = self.config.baseline_attention
        if choice == "auto":
            return next(self.model.parameters()).device.type == "meta"
        return choice == "engine"

    @property
    def _float64_head(self) -> bool:
        """Whether the logits are float64: transformers' own loss would compute them in float32
        (`logits.float()`), so the loss is taken from the logits here, in float64."""
        return self.parts.lm_head.weight.dtype == torch.float64

    def mask_argument(self, attention_mask):
        """The attention mask in the form the model's attention implementation expects. Under the engine
        attention, a hybrid model's linear-attention layers (Qwen3.5's Gated DeltaNet) get the (B, T)
        padding mask transformers builds for them, the attention layers the engine's (B, 1, 1, T) one."""
        if not self.uses_engine_attention:
            return self._meta_mask(attention_mask)
        key_valid = key_padding(attention_mask)
        mask = engine_mask_argument(key_valid)
        layer_types = getattr(self.parts.backbone.config, "layer_types", None) or ()
        if key_valid is None or "linear_attention" not in layer_types:
            return mask
        return {kind: key_valid if kind == "linear_attention" else mask for kind in set(layer_types)}

    def _meta_mask(self, attention_mask):
        """On the meta device, a model that keeps its own attention there (`uses_engine_attention`) gets an
        all-ones (B, T) mask for an absent one: without a mask transformers reads the position_ids' values
        to find packed rows, which meta tensors do not hold; the mask it builds is the same."""
        ids = self._input_ids
        if attention_mask is not None or ids.device.type != "meta":
            return attention_mask
        return torch.ones_like(ids)

    def model_inputs(self, attention_mask, packed: PackedRows | None) -> dict:
        """The attention mask and position_ids arguments of the model's forward. Packed rows go through
        transformers' own packed path (position_ids that restart, no mask), or under the engine attention
        a per-document mask (`engine.packing`). Under sequence parallelism: the whole sequence's key mask
        and this shard's global positions (`engine.sequence.hf`)."""
        shard = self._step_shard
        if shard is not None:
            mask = sequence_mask_argument(shard.key_valid, self._input_ids.shape[0], shard.shard.total_tokens,
                                          self._input_ids.device)
            return {"attention_mask": mask, "position_ids": shard.positions}
        if packed is None:
            return {"attention_mask": self.mask_argument(attention_mask)}
        if self.uses_engine_attention:
            return {"attention_mask": packed.attention_mask(), "position_ids": packed.positions}
        return {"attention_mask": None, "position_ids": packed.hf_position_ids()}

    def _loss(self, input_ids, attention_mask, labels, packed=None, **objective_inputs):
        inputs = self.model_inputs(attention_mask, packed)
        mask = inputs["attention_mask"]
        unpadded = packed is None or not packed.padded  # else transformers' router loss would count padding
        whole = self._step_shard is None  # a shard's loss needs the whole sequence's (`methods.sequence`)
        if self.objective_name == "sft" and not objective_inputs and not self._float64_head and unpadded \
                and whole:
            return self.model(input_ids=input_ids, **inputs, labels=labels, use_cache=False).loss
        if self.config.baseline_loss == "trl" and self.objective_name != "sft":
            return self._trl_loss(input_ids, mask, attention_mask, labels, objective_inputs)
        outputs = self.model(input_ids=input_ids, **inputs, use_cache=False)
        loss = full_logits_loss(self, outputs.logits, labels, **objective_inputs)
        return loss + self.router_loss(getattr(outputs, "router_logits", None), attention_mask)

    def _trl_loss(self, input_ids, mask, attention_mask, labels, inputs):
        """The objective's loss as TRL 0.17's GRPO or DPO trainer computes it (checked as the objective)."""
        self.make_objective(labels, **inputs)
        grpo = self.objective_name == "grpo"
        if grpo and inputs.get("completion_mask") is None:
            inputs = {**inputs, "completion_mask": (labels != IGNORE_INDEX).long()}
        keep = trl_loss.grpo_logits_to_keep(input_ids, inputs) + 1 if grpo else 0
        outputs = self.model(input_ids=input_ids, attention_mask=mask, use_cache=False, logits_to_keep=keep)
        router = self.router_loss(getattr(outputs, "router_logits", None), attention_mask)
        if grpo:
            return trl_loss.grpo_loss(outputs, input_ids, inputs) + router
        return trl_loss.dpo_loss(outputs.logits, labels, inputs) + router
