"""LoRA through peft: rank, alpha, every linear layer of the decoder, dropout 0."""

from __future__ import annotations

import importlib.util
import warnings

from torch import nn

from streambp_core.config import ConfigError

LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj",
                "qkv_proj", "gate_up_proj")
"""Every linear layer of a decoder layer, by name (Phi-3's fused `qkv_proj` and `gate_up_proj` too)."""


def apply_lora(model: nn.Module, rank: int, alpha: float | None = None) -> nn.Module:
    """Wrap `model` with LoRA adapters (rank `rank`, alpha default 4 x rank as in the paper's runs).

    Only adapter weights require grad afterwards; the base weights are frozen.
    """
    if not isinstance(rank, int) or rank <= 0:
        raise ConfigError(f"LoRA rank must be a positive integer, got {rank!r}")
    if importlib.util.find_spec("peft") is None:
        raise ConfigError("LoRA needs peft: pip install 'streambp-bench[lora]'")
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(r=rank, lora_alpha=alpha if alpha is not None else 4 * rank, lora_dropout=0.0,
                        target_modules=list(LORA_TARGETS), bias="none", task_type="CAUSAL_LM")
    with warnings.catch_warnings():  # peft reads transformers' deprecated `is_gradient_checkpointing`
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.* is deprecated",
                                category=FutureWarning)
        return get_peft_model(model, config)
