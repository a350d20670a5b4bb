"""Model configs and models by name: shipped presets, local directories, random or loaded weights.

Nothing here touches the network: presets are `config.json` files shipped in `presets/`, and local
directories are read with `local_files_only=True`.
"""

from __future__ import annotations

import copy
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, PretrainedConfig, PreTrainedModel
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from streambp_core.config import PRESET_DIR as PRESET_DIR
from streambp_core.config import ConfigError, preset_names
from streambp_core.models.adapters import (
    MOE_FAMILIES,
    SUPPORTED_FAMILIES,
    TINY_FAMILIES,
    family_of,
    model_family,
)
from streambp_core.models.catalogue import ModelFile, model_file, refusal, serving
from streambp_core.models.config_file import check_geometry, config_from_values
from streambp_core.models.families import TEXT_WRAPPERS
from streambp_core.models.precision import float32_islands_widened
from streambp_core.models.wrapped import load_wrapped_weights

SUPPORTED_MODEL_TYPES = SUPPORTED_FAMILIES
"""`model_type`s of the decoder families the engine supports (`adapters.FAMILIES`)."""


def list_presets() -> list[str]:
    """Names of the shipped presets: real models by their hub name first, then the `tiny/*` test models."""
    return list(preset_names())


def check_supported(config: PretrainedConfig, source: str = "model") -> PretrainedConfig:
    """Return `config` if a path serves its family (`models.catalogue`: the engine's, with no feature the
    engine cannot run exactly, or the baselines'), else raise ConfigError (one line) naming why and what
    each method accepts, or the refused feature."""
    tier = serving(config.model_type)
    if tier.path == "refused":
        raise ConfigError(f"{source}: {refusal(config.model_type, tier.reason)}")
    if tier.path == "baselines":
        if getattr(config, "is_encoder_decoder", False):
            why = "an encoder-decoder (is_encoder_decoder)"
            raise ConfigError(f"{source}: {refusal(config.model_type, why)}")
        if not isinstance(getattr(config, "num_hidden_layers", None), int):
            why = "its config has no num_hidden_layers (a model of nested sub-models)"
            raise ConfigError(f"{source}: {refusal(config.model_type, why)}")
        return config
    try:
        model_family(config)
    except ConfigError as error:
        raise ConfigError(f"{source}: {error}") from None
    return config


def load_config(name_or_path: str) -> PretrainedConfig:
    """Config of a preset (hub name, case-insensitive) or of a local directory (or file) with config.json.

    Raises ConfigError, on one line, for an unknown name (listing the presets) or an unsupported family.
    """
    return config_of(model_file(name_or_path))


def config_of(found: ModelFile) -> PretrainedConfig:
    """The checked config of a model the catalogue found (`catalogue.model_file`), from the values it read."""
    return check_supported(config_from_values(found.values, found.preset or str(found.file)), found.source)


def tiny_config(family: str = "qwen3", **overrides: object) -> PretrainedConfig:
    """A copy of the `tiny/<family>` preset (2 layers, hidden 64, vocab 512) with `overrides` applied.

    Example: `tiny_config("llama", num_key_value_heads=1, tie_word_embeddings=True)`.
    """
    if family not in TINY_FAMILIES:
        raise ConfigError(f"unknown tiny family {family!r}; choose from {', '.join(TINY_FAMILIES)}")
    values = model_file(f"tiny/{family}").values
    unknown = sorted(set(overrides) - set(values) - _known_keys(values["model_type"]))
    if unknown:
        raise ConfigError(f"tiny_config({family!r}): unknown config keys {', '.join(unknown)}")
    return config_from_values({**values, **overrides}, f"tiny/{family}")


def _known_keys(model_type: str) -> set[str]:
    return set(CONFIG_MAPPING[model_type]().to_dict())


def checked_config(config_or_name: PretrainedConfig | str) -> PretrainedConfig:
    """The named config loaded (`load_config`), or a validated copy of a given config (geometry, family,
    features; ConfigError otherwise): what `build_model` may trust (`checked=True`)."""
    if isinstance(config_or_name, PretrainedConfig):
        config = text_model_config(config_or_name)
        check_geometry(config, "config")
        return check_supported(config)
    return load_config(config_or_name)


def text_model_config(config: PretrainedConfig) -> PretrainedConfig:
    """A copy of the config of the model the engine runs: a multimodal wrapper's text model (gemma3's
    `text_config`, tied to the embeddings as the wrapper says), else of `config` itself."""
    if config.model_type not in dict(TEXT_WRAPPERS):
        return copy.deepcopy(config)
    text = copy.deepcopy(config.text_config)
    text.tie_word_embeddings = getattr(config, "tie_word_embeddings", True)
    return text


def _prepare_for_training(model: PreTrainedModel) -> PreTrainedModel:
    """Train mode with the dropout the config sets (trained as configured: plain and checkpoint, whose
    recompute replays the forward's random masks, run it exactly; streambp and mst, which recompute
    without replaying them, refuse it by name when prepared); norms and routers that would round a float64
    model to float32 compute in at least float32 (`models.precision.float32_islands_widened`)."""
    return float32_islands_widened(model).train()


def build_model(
    config_or_name: PretrainedConfig | str,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    seed: int = 0,
    attn_implementation: str = "sdpa",
    checked: bool = False,
) -> PreTrainedModel:
    """A randomly initialised `*ForCausalLM` in train mode (with its configured dropout) on `device`.

    `device="meta"` allocates no memory (shapes only), e.g. to count parameters of a 32B model.
    The same `seed`, config, dtype and device give the same weights. `checked`: the config was validated
    already (`checked_config`, `load_config`) and is trusted as it is; the model gets a shallow copy of it
    (its dtype and attention settings are its own), never a deep one.
    """
    config = copy.copy(config_or_name) if checked else checked_config(config_or_name)
    torch.manual_seed(seed)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(
            config, dtype=dtype, attn_implementation=attention_for(config, attn_implementation),
            **experts_options(config, dtype))
    return _prepare_for_training(_all_on(model, torch.device(device)))


def _all_on(model: PreTrainedModel, device: torch.device) -> PreTrainedModel:
    """`model` with every parameter and buffer on `device`. The device context reaches torch's factory
    functions only: a tensor a model's `__init__` makes another way (DiffLlama's `torch.normal(0, std,
    size=...)`, XLNet's `torch.FloatTensor(...)`) lands on the CPU, and a meta step would mix devices."""
    tensors = (*model.parameters(), *model.buffers())
    return model.to(device) if any(t.device.type != device.type for t in tensors) else model


def attention_for(config: PretrainedConfig, attn_implementation: str) -> str:
    """The attention implementation a model of `config` is built with: the one asked for, except SDPA for
    a family transformers runs without it (`Family.sdpa`: gpt-oss, Gemma 2; a baselines family whose
    class does not support it): eager."""
    if attn_implementation != "sdpa":
        return attn_implementation
    if config.model_type in SUPPORTED_FAMILIES:
        return "sdpa" if family_of(config.model_type).sdpa else "eager"
    model_class = AutoModelForCausalLM._model_mapping.get(type(config), None)
    return "sdpa" if getattr(model_class, "_supports_sdpa", False) else "eager"


def experts_options(config: PretrainedConfig, dtype: torch.dtype) -> dict[str, str]:
    """How a mixture-of-experts model runs its experts: transformers' default (grouped matmuls, which
    also run on the meta device), except in float64, which grouped matmuls do not take: there the
    per-expert loop (`eager`; asked of every baselines family, which a model without experts ignores).
    Empty for the engine's dense families."""
    engine_dense = config.model_type in SUPPORTED_FAMILIES and config.model_type not in MOE_FAMILIES
    if engine_dense or dtype != torch.float64:
        return {}
    return {"experts_implementation": "eager"}


def has_weights(path: str | Path) -> bool:
    """Whether a local directory holds safetensors weights that `load_model` can read."""
    return Path(path).is_dir() and any(Path(path).glob("*.safetensors"))


def load_model(
    path: str | Path,
    *,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    attn_implementation: str = "sdpa",
) -> PreTrainedModel:
    """Load a local directory's config and safetensors weights (never the network), in train mode with
    its configured dropout. A multimodal wrapper's directory (gemma3) loads as its text model, with the
    text model's weights (`models.wrapped`)."""
    if not has_weights(path):
        raise ConfigError(f"{path} has no *.safetensors weights")
    found = model_file(str(path))
    config = config_of(found)
    if found.values.get("model_type") in dict(TEXT_WRAPPERS):
        model = build_model(config, dtype=dtype, device=device, attn_implementation=attn_implementation,
                            checked=True)
        return load_wrapped_weights(model, path)
    model = AutoModelForCausalLM.from_pretrained(
        str(path), dtype=dtype, local_files_only=True,
        attn_implementation=attention_for(config, attn_implementation),
        **experts_options(config, dtype),
    )
    return _prepare_for_training(model.to(device))


def count_parameters(model: torch.nn.Module) -> int:
    """Number of distinct parameter elements (tied embeddings counted once)."""
    return sum(param.numel() for param in model.parameters())
