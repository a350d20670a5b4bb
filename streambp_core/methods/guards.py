"""Checks `prepare` and `run.loss` make before touching a model, so misuse is a one-line ConfigError
instead of a traceback or a silently wrong gradient:

- the model is a transformers `*ForCausalLM` (optionally peft-wrapped) of a supported family;
- no other run is open on it (closing the first would silently undo the second);
- no dropout is active in a module the method recomputes outside torch's checkpoint (whose
  `preserve_rng_state` replays the forward's random masks): a recompute with fresh masks would give
  gradients of a different function than the forward computed;
- the batch is non-empty, its token ids are in the vocabulary, and a cross-entropy has a target;
- a left-padded batch is not streamed through a model that attends with transformers' own eager
  attention, whose padding positions before the first real token differ from the engine's
  (`check_eager_padding`).
"""

from __future__ import annotations

import inspect
import weakref
from collections.abc import Iterable, Iterator

import torch
from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.engine.stream.objectives import IGNORE_INDEX
from streambp_core.models.adapters import DecoderParts, decoder_parts, layer_parts
from streambp_core.models.catalogue import serving

OPEN_RUN_ATTRIBUTE = "_streambp_open_run"
"""Attribute of a prepared model's decoder stack: a weak reference to the run that prepared it."""


def parts_of(model: nn.Module) -> DecoderParts:
    """The decoder pieces of `model`, or ConfigError when it is not a transformers causal LM."""
    from transformers import PreTrainedModel

    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    if not isinstance(base, PreTrainedModel):
        raise ConfigError(
            "prepare() takes a transformers *ForCausalLM (optionally peft-wrapped), "
            f"got {type(model).__name__}"
        )
    try:
        return decoder_parts(model)
    except AttributeError as error:
        raise ConfigError(
            f"prepare() takes a *ForCausalLM with a decoder stack and an lm_head; {type(base).__name__} "
            f"has no {error.name or 'such part'}"
        ) from None


def family_refusals(config) -> dict[str, str]:
    """The methods a model of `config` (a checked transformers config) cannot run because of its family,
    each with its one-line refusal: none for an engine family; for the baselines tier (`models.catalogue`)
    mst where its pieces do not apply (`models.generic.mst_pieces`), streambp where its decoder layers
    cannot be streamed whatever the run (`engine.own.refusals`: a layer that is no transformers
    `GradientCheckpointingLayer`), both decided on the model built on the meta device. What a command
    running every method leaves out, naming why; streambp's other refusals on the own-layer path come when
    its run is prepared."""
    from streambp_core.engine.own.refusals import layers_refusal, refusal_message
    from streambp_core.models.generic import mst_pieces
    from streambp_core.models.load import build_model

    if serving(config.model_type).path != "baselines":
        return {}
    model = build_model(config, device="meta", checked=True)
    layers = decoder_parts(model).layers
    refusals = {}
    try:
        mst_pieces(model, layers)
    except ConfigError as error:
        refusals["mst"] = str(error)
    cause = layers_refusal(layers)
    if cause is not None:
        refusals["streambp"] = refusal_message(config.model_type, cause)
    return refusals


def refuse_prompt_learning(model: nn.Module, method: str) -> None:
    """ConfigError when `model` is a peft prompt-learning model (prompt tuning, prefix tuning, p-tuning):
    its virtual tokens are added by peft's forward, which `method` does not run, so it would train
    without them."""
    config = getattr(model, "active_peft_config", None)
    if getattr(config, "is_prompt_learning", False):
        kind = getattr(config, "peft_type", "prompt learning")
        raise ConfigError(
            f"{method} cannot train a peft prompt-learning model ({getattr(kind, 'value', kind)}): its "
            f"virtual tokens are added by peft's forward, which {method} does not run; use plain or "
            "checkpoint, or LoRA"
        )


def claim(parts: DecoderParts, run: object) -> None:
    """Mark the model as prepared by `run`; ConfigError when another run on it is still open."""
    previous = getattr(parts.backbone, OPEN_RUN_ATTRIBUTE, None)
    holder = previous() if previous is not None else None
    if holder is not None and not getattr(holder, "closed", True):
        raise ConfigError(
            f"this model is already prepared for {holder.method} and that run is still open; close it "
            "(run.close() or leave its with-block) before preparing the model again"
        )
    setattr(parts.backbone, OPEN_RUN_ATTRIBUTE, weakref.ref(run))


def release(parts: DecoderParts, run: object) -> None:
    """Remove the mark `claim` left, if it is `run`'s."""
    current = getattr(parts.backbone, OPEN_RUN_ATTRIBUTE, None)
    if current is not None and current() in (run, None):
        delattr(parts.backbone, OPEN_RUN_ATTRIBUTE)


def active_dropout(modules: Iterable[nn.Module]) -> Iterator[tuple[str, float]]:
    """(where, probability) of every dropout that is on in `modules` and their children: an nn.Dropout
    with p > 0 in train mode, or an attention module in train mode with `attention_dropout` > 0."""
    for root in modules:
        for module in root.modules():
            if module.training and isinstance(module, nn.modules.dropout._DropoutNd) and module.p > 0:
                yield type(module).__name__, float(module.p)
        yield from attention_dropout(root.modules())


def attention_dropout(modules: Iterable[nn.Module]) -> Iterator[tuple[str, float]]:
    """(where, probability) of the modules among `modules` (not their children) whose transformers
    forward applies dropout: to the attention probabilities (`attention_dropout`), or to the attention or
    MLP output before its residual (Seed-OSS's `residual_dropout`)."""
    for module in modules:
        for attribute in ("attention_dropout", "residual_dropout"):
            rate = getattr(module, attribute, None)
            if module.training and isinstance(rate, float) and rate > 0:
                yield f"{type(module).__name__}.{attribute}", rate


def refuse_dropout(method: str, found: Iterable[tuple[str, float]], why: str) -> None:
    """ConfigError naming the first active dropout in `found`, which `method` cannot run exactly."""
    first = next(iter(found), None)
    if first is not None:
        name, rate = first
        raise ConfigError(
            f"{method} cannot train with dropout exactly ({name} p={rate:g} in train mode): {why}; "
            "set the dropout to 0 (attention_dropout, lora_dropout) or call model.eval()"
        )


def check_tokens(input_ids: Tensor, vocab_size: int) -> None:
    """ConfigError for an empty batch, non-integer ids, or ids outside 0..vocab_size-1 (one host sync)."""
    if input_ids.shape[0] == 0:
        raise ConfigError("the batch is empty: input_ids has 0 rows")
    if input_ids.dtype.is_floating_point or input_ids.dtype.is_complex or input_ids.dtype == torch.bool:
        raise ConfigError(f"input_ids must hold integer token ids, got dtype {input_ids.dtype}")
    if input_ids.device.type != "meta" and bool(((input_ids < 0) | (input_ids >= vocab_size)).any()):
        raise ConfigError(f"input_ids holds token ids outside the vocabulary 0..{vocab_size - 1}")


def check_labels(labels: Tensor, vocab_size: int) -> None:
    """ConfigError for labels that are neither -100 (ignored) nor a token id of the vocabulary (one host
    sync): the loss would index outside the logits."""
    if labels.dtype.is_floating_point or labels.dtype.is_complex or labels.dtype == torch.bool:
        raise ConfigError(f"labels must hold integer token ids (or {IGNORE_INDEX}), got dtype {labels.dtype}")
    if labels.device.type == "meta":
        return
    outside = (labels != IGNORE_INDEX) & ((labels < 0) | (labels >= vocab_size))
    if bool(outside.any()):
        first = int(labels[outside][0])
        raise ConfigError(f"labels holds {first}, outside the vocabulary 0..{vocab_size - 1} (and not "
                          f"{IGNORE_INDEX}, the ignored label)")


def check_sft_targets(labels: Tensor) -> None:
    """ConfigError when no position has a target (every shifted label is -100): the mean cross-entropy
    would be 0/0 = NaN."""
    if labels.device.type != "meta" and not bool((labels[:, 1:] != IGNORE_INDEX).any()):
        raise ConfigError(
            "every label is -100 (ignored) after the shift, so the cross-entropy has no target token "
            "and its mean would be NaN; label at least one token after the first"
        )


def watch_versions(loss: Tensor, model: nn.Module) -> Tensor:
    """`loss`, with a hook that raises at the start of its backward, as torch's own in-place check does,
    when a trainable parameter of `model` was changed in place after the loss was computed: a method
    that recomputes from the weights would otherwise return a gradient of neither the old nor the new
    weights (plain backprop raises the same error through its saved tensors)."""
    if not loss.requires_grad:
        return loss
    named = [(name, param) for name, param in model.named_parameters() if param.requires_grad]
    versions = [param._version for _, param in named]

    def check(grad: Tensor) -> Tensor:
        for (name, param), version in zip(named, versions, strict=True):
            if param._version != version:
                raise RuntimeError(
                    "one of the variables needed for gradient computation has been modified by an "
                    f"inplace operation: parameter {name} {list(param.shape)} is at version "
                    f"{param._version}; expected version {version} instead (it changed between "
                    "run.loss() and backward(); compute the loss again after changing the weights)"
                )
        return grad

    loss.register_hook(check)
    return loss


def check_eager_padding(config, attention_mask: Tensor | None, method: str) -> None:
    """ConfigError when `attention_mask` pads a row before its first real token (left padding) and the
    model of `config` (its decoder stack's) attends through transformers' own eager attention: eager adds
    the dtype's minimum to every masked score, so a query that sees no key (a padding position before the
    row's first token) gets the same score for every key and outputs the mean of every value of its row,
    later tokens included, and the loss reads it where that position predicts the row's first token;
    `method`'s attention (the engine's, as SDPA and flash-attention) gives it zeros. gpt-oss's sinks take
    such a query's whole softmax, so its eager gives zeros too (`models.precision.EAGER_KEYLESS_ZEROS`); a
    float64 model attends as `models.precision.WIDE_EAGER` while a run is open. One check of the mask per
    step."""
    from streambp_core.models.precision import EAGER_KEYLESS_ZEROS

    if attention_mask is None or config.model_type in EAGER_KEYLESS_ZEROS:
        return
    if config._attn_implementation != "eager" or attention_mask.dim() != 2:
        return
    if bool(((attention_mask[:, 0] == 0) & (attention_mask != 0).any(dim=1)).any()):
        raise ConfigError(
            f"{method} cannot stream left padding through a {config.model_type} model with transformers' "
            "eager attention: eager gives a padding position before a row's first token the mean of every "
            "value of the row, which the loss reads where it predicts that token; pad on the right, or "
            "build the model with attn_implementation='sdpa' or 'flash_attention_2' (Gemma 2, which has no "
            "SDPA: call streambp_core.models.precision.eager_in_at_least_float32(model) or build it with "
            "streambp_core.models.build_model)")


ATTENTION_LAYER_TYPES = ("full_attention", "sliding_attention", "chunked_attention", "attention")
"""`layer_types` entries of layers that attend (and so take a packed row's per-document mask); any other
kind (mamba, conv, linear_attention, ...) carries state from one token to the next."""


def check_packing(parts: DecoderParts) -> None:
    """ConfigError naming why packed rows (position_ids restarting per document) cannot run on this model:
    an engine family with Gated DeltaNet layers; a family of the baselines tier (transformers' own forward)
    whose forward takes no position_ids (it cannot tell the documents apart) or that has layers other than
    attention (`ATTENTION_LAYER_TYPES`): their conv and recurrent state run across a row's documents, which
    transformers' torch path does not reset."""
    if serving(parts.family).path == "engine":
        if any(layer_parts(layer).delta is not None for layer in parts.layers):
            raise ConfigError("packed rows (position_ids restarting per document) are not supported with "
                              "Gated DeltaNet linear attention (Qwen3.5): its conv and recurrent state run "
                              "across a row's documents (transformers' torch path does not reset them)")
        return
    what = f"packed rows (position_ids restarting per document) are not supported for architecture " \
           f"{parts.family!r}"
    if "position_ids" not in inspect.signature(parts.backbone.forward).parameters:
        raise ConfigError(f"{what}: its forward takes no position_ids, from which transformers tells the "
                          "documents apart; pass each document in its own row")
    kinds = getattr(parts.backbone.config, "layer_types", None) or ()
    other = next((kind for kind in kinds if kind not in ATTENTION_LAYER_TYPES), None)
    if other is not None:
        raise ConfigError(f"{what}: its {other!r} layers carry state across a row's documents (transformers' "
                          "torch path does not reset it); pass each document in its own row")
