"""Trainer features a prepared model cannot serve, each refused by name in one line before training."""

from __future__ import annotations

import gc

import torch

from streambp_core.config import ConfigError, check_method
from streambp_core.integrations.engines import engine_refusals
from streambp_core.registry import method_class

FUSED_HEAD_TRAINERS = ("SFTTrainer", "DPOTrainer", "GRPOTrainer", "RLOOTrainer", "KTOTrainer")
"""TRL trainers that score tokens with TRL's fused LM head on top of the decoder stack (TRL >= 1.15)."""
LOGITS = "it needs the full logits"


def check_trainer(trainer, method: str) -> None:
    """Raise ConfigError naming the first setting of `trainer` that cannot work with a `method` model."""
    for refused, setting, why in _refusals(trainer, method):
        if refused:
            raise ConfigError(f"{setting} cannot train a {method} model: {why}")
    dropout = _active_dropout(trainer.model)
    if method == "streambp" and dropout:
        raise ConfigError(f"dropout ({dropout}) cannot train a {method} model: the streamed backward "
                          "recomputes each chunk and would draw new dropout masks; set it to 0")
    sibling = _sibling_built_from_another_config_state(trainer.model)
    if sibling:
        raise ConfigError(sibling)
    if _is_trl(trainer) and not _has_fused_head(trainer):
        raise ConfigError(f"{type(trainer).__name__} from this TRL version computes full logits; "
                          "install trl>=1.15 (its trainers score tokens with a fused LM head)")


def _refusals(trainer, method: str) -> list[tuple[bool, str, str]]:
    args = trainer.args
    packing = getattr(args, "padding_free", False) or getattr(args, "packing", False)
    no_logits = method_class(check_method(method)).drives_modules  # answers a loss call without full logits
    return [
        (packing and not _packs_sft(trainer), f"padding_free or packing with {type(trainer).__name__}",
         "packed rows train the sft objective only (sequence scores would mix documents)"),
        (no_logits and args.label_smoothing_factor > 0, "label_smoothing_factor", LOGITS),
        (no_logits and trainer.compute_loss_func is not None, "compute_loss_func", LOGITS),
        (no_logits and trainer.compute_metrics is not None, "compute_metrics", LOGITS),
        (no_logits and trainer.preprocess_logits_for_metrics is not None, "preprocess_logits_for_metrics",
         LOGITS),
        (trainer.model_init is not None, "model_init", "the trainer would build a new, unprepared model"),
        *engine_refusals(trainer, method),
        (_autocast_over_full_precision(trainer), "bf16/fp16 mixed precision over float32/float64 weights",
         "the streamed layers compute in the weights' dtype; load the model in bfloat16 instead"),
        (_prompt_learning(trainer.model), "a prompt-learning adapter (prefix/prompt tuning)",
         "it prepends virtual tokens; use LoRA"),
    ]


def _packs_sft(trainer) -> bool:
    """Whether the trainer's loss is per token (transformers' Trainer, TRL's SFTTrainer): packed rows fit."""
    names = [cls.__name__ for cls in type(trainer).__mro__]
    return "SFTTrainer" in names or not _is_trl(trainer)


def _active_dropout(model) -> str:
    """The name of the first dropout module with p > 0 in `model` (e.g. a LoRA dropout), or ''."""
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Dropout) and module.p > 0:
            return f"{name}.p={module.p}"
    return ""


def _sibling_built_from_another_config_state(model) -> str:
    """Why `model` cannot be compared with another live model that shares its config object, or ''.

    `from_config` keeps the config object it is given, and a trainer aligns the config's special tokens
    with its tokenizer when it is built. A second model built from that config object after a first
    trainer was built is therefore built with the new `pad_token_id`: its embedding has a padding row
    (zero at initialisation, no gradient from the lookup), the first model's has none. The two models then
    train apart from their first step, whatever the method, and a user comparing them would blame the method.
    """
    base = _base_model(model)
    config, embedding = getattr(base, "config", None), _input_embeddings(base)
    if config is None or embedding is None:
        return ""
    own = {id(module) for module in model.modules()}
    padding = getattr(embedding, "padding_idx", None)
    for other in gc.get_objects():  # a model no longer referenced but not yet collected counts: it was built
        if not issubclass(type(other), torch.nn.Module) or id(other) in own:  # type(): no lazy getattr
            continue
        theirs = _input_embeddings(other) if getattr(other, "config", None) is config else None
        if theirs is not None and getattr(theirs, "padding_idx", None) != padding:
            return (f"this model shares its config object with another model built before a trainer changed "
                    f"it (embedding padding_idx {padding} here, {theirs.padding_idx} there): the two differ "
                    "from their first step whatever the method; build each model from its own "
                    "copy.deepcopy(config)")
    return ""


def _base_model(model):
    """The transformers model inside a peft wrapper, or `model`."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model


def _input_embeddings(model) -> torch.nn.Module | None:
    get = getattr(model, "get_input_embeddings", None)
    try:
        return get() if callable(get) else None
    except (NotImplementedError, AttributeError):
        return None


def _autocast_over_full_precision(trainer) -> bool:
    args = trainer.args
    if not (args.bf16 or args.fp16):
        return False
    frozen_or_all = [p for p in trainer.model.parameters() if not p.requires_grad] or list(
        trainer.model.parameters())
    return any(p.dtype in (torch.float32, torch.float64) for p in frozen_or_all)


def _prompt_learning(model) -> bool:
    config = getattr(model, "active_peft_config", None)
    return bool(getattr(config, "is_prompt_learning", False))


def _is_trl(trainer) -> bool:
    return any(cls.__module__.startswith("trl.") for cls in type(trainer).__mro__)


def _has_fused_head(trainer) -> bool:
    try:
        from trl.trainer.utils import add_fused_lm_head  # noqa: F401
    except ImportError:
        return False
    return any(cls.__name__ in FUSED_HEAD_TRAINERS for cls in type(trainer).__mro__)
