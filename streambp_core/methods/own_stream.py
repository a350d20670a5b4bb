"""streambp by construction: a family of the baselines tier (`models.catalogue`) streamed through its own
decoder-layer modules (`engine.own`) rather than the engine's layer math.

The model's own forward runs with each decoder layer as `engine.own.layer.OwnLayer` (only each layer's
input kept); the LM head streams as the engine's (`engine.stream.head`) where the logits are the lm_head's
output alone (`models.generic.head_is_lm_head`), else the model's own logits are taken whole. With
`baseline_attention` "engine" ("auto" on the meta device, as a simulation runs it) the layers attend through
the engine's prefix-attention kernel (`engine.attention.hf`), as plain and checkpoint do: transformers then
builds no mask (its mask code reads tensor values, which meta tensors have none of), the padding reaches
each layer as a (B, 1, 1, T) key mask, and a chunk's queries are the last rows of its keys. The model
attends so from preparing to `close()`, since each layer's backward runs its forward again. Layers whose
attention is more than the kernel takes (`methods.plain.attends_beyond_the_kernel`: DSA's pick, DeepSeek-V4's
compressed blocks) keep their own attention on the meta device too, given an all-ones mask for an absent one,
as plain does. What this path
does not carry is refused by name: sequence parallelism, sharded or DeepSpeed-wrapped models, offload
tiers, packed rows, the router load-balancing loss, layers that are not transformers'
`GradientCheckpointingLayer`, a float64 DeepSeek-V4 that keeps float32 pieces
(`models.precision_v4.float32_pieces`).
"""

from __future__ import annotations

from contextlib import ExitStack

import torch
from torch import Tensor

from streambp_core.config import ConfigError
from streambp_core.engine.attention.hf import ENGINE_ATTENTION_NAMES, engine_attention, engine_mask_argument
from streambp_core.engine.chunks import trainable_parameters
from streambp_core.engine.engines.fsdp_unit import is_sharded
from streambp_core.engine.engines.reduction import zero_stage_of
from streambp_core.engine.own.layer import OwnPlan, streamed_layers
from streambp_core.engine.own.refusals import layers_refusal, refusal_message
from streambp_core.engine.stream.head import FusedHead, HeadPlan, StreamedHead
from streambp_core.methods import guards
from streambp_core.methods.base import Run, full_logits_loss, key_padding
from streambp_core.methods.plain import attends_beyond_the_kernel
from streambp_core.models.generic import head_is_lm_head
from streambp_core.models.precision_v4 import float32_pieces


class OwnStream:
    """streambp's steps on a model of the baselines tier (module docstring)."""

    def __init__(self, run: Run) -> None:
        """ConfigError, naming the cause, for what this path cannot run exactly."""
        self.run = run
        cause = _refusal(run)
        if cause is not None:
            raise ConfigError(refusal_message(run.parts.family, cause))
        config = run.config
        self.engine_attention = uses_engine_attention(run)
        """Whether the layers attend through the engine's kernel (module docstring)."""
        implementation = (ENGINE_ATTENTION_NAMES[config.attn] if self.engine_attention
                          else run.parts.backbone.config._attn_implementation or "eager")
        self.plan = OwnPlan(config.partition_size, implementation, config.keep_chunks)
        model = run.model
        base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
        self.head = None
        """The streamed head, or None where the logits are more than the lm_head's output."""
        if head_is_lm_head(base):
            self.head = HeadPlan(None, run.parts.lm_head, config.head_partition_size, config.keep_chunks)
        self.head_function = FusedHead if config.head_mode == "fused" else StreamedHead
        self._attention = ExitStack()
        if self.engine_attention:
            self._attention.enter_context(engine_attention(model, config.attn))

    def close(self) -> None:
        """Give the model its own attention implementation back."""
        self._attention.close()

    def loss(self, input_ids: Tensor, attention_mask: Tensor | None, labels: Tensor,
             **objective_inputs) -> Tensor:
        """The step's loss: the model's own stack with streamed layers, then the head."""
        run, parts = self.run, self.run.parts
        guards.check_eager_padding(parts.backbone.config, attention_mask, run.method)
        if self.engine_attention:
            attention_mask = engine_mask_argument(key_padding(attention_mask))
        elif attention_mask is None and input_ids.device.type == "meta":
            attention_mask = torch.ones_like(input_ids)  # plain's `_meta_mask`: the same mask, read no value
        with streamed_layers(parts.layers, self.plan):
            if self.head is None:
                logits = run.model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
                return full_logits_loss(run, logits, labels, **objective_inputs)
            hidden = parts.backbone(input_ids=input_ids, attention_mask=attention_mask,
                                    use_cache=False).last_hidden_state
        objective = run.make_objective(labels, **objective_inputs)
        return self.head_function.apply(hidden, objective, self.head, *trainable_parameters([parts.lm_head]))


def _refusal(run: Run) -> str | None:
    """What of `run`'s setting the own-layer path does not carry, in a clause; None when it carries all."""
    config = run.config
    layers = run.parts.layers
    structural = layers_refusal(layers)
    narrow = float32_pieces(run.model)
    causes = (
        (structural is not None, structural),
        (bool(narrow), f"the float32 pieces DeepSeek-V4 keeps in a float64 model ({len(narrow)} "
                       f"parameters: {(narrow or [''])[0]}, ...), recomputed in float32 and so exact to "
                       "float32's accuracy only; build it with build_model or call model.double()"),
        (run.sequence_group is not None, "sequence parallelism"),
        (run.parts.embed.weight.device.type == "meta" and not uses_engine_attention(run)
         and not any(attends_beyond_the_kernel(layer) for layer in layers),
         "the meta device of a simulation under the model's own attention (transformers' masks read tensor "
         "values there; baseline_attention 'engine' or 'auto' runs it)"),
        (bool(config.offload), f"offload tiers ({config.offload})"),
        (zero_stage_of(run.model) is not None, "DeepSpeed ZeRO"),
        (any(is_sharded(layer) for layer in run.parts.layers), "FSDP2 sharding"),
        (run.router_aux is not None, "the router load-balancing loss (output_router_logits)"),
    )
    return next((cause for refused, cause in causes if refused), None)


def uses_engine_attention(run: Run) -> bool:
    """Whether the own-layer path attends through the engine's kernel: `baseline_attention` "engine", or
    "auto" on the meta device (`StreamConfig.baseline_attention`); never where a layer's attention is more
    than the kernel takes (`methods.plain.attends_beyond_the_kernel`: a sparse-attention indexer's pick),
    as for plain."""
    if any(attends_beyond_the_kernel(layer) for layer in run.parts.layers):
        return False
    choice = run.config.baseline_attention
    if choice == "auto":
        return run.parts.embed.weight.device.type == "meta"
    return choice == "engine"


def refuse_packed(packed) -> None:
    """ConfigError for packed rows (position_ids restarting per document) on the own-layer path."""
    if packed is not None:
        raise ConfigError("streambp: packed rows (position_ids restarting per document) are not supported "
                          "through a model's own decoder layers; plain and checkpoint run them")
