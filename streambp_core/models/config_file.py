"""Reading a model's config.json and checking its geometry, with one-line errors naming the file.

A malformed model directory (config.json that is not JSON or not an object, no or an unknown
`model_type`, head counts that do not divide, layer types the engine has no kernel for) raises
ConfigError here, before a model is built, instead of a traceback from deep inside transformers.
"""

from __future__ import annotations

from types import SimpleNamespace
from typing import TYPE_CHECKING

from streambp_core.config import ConfigError
from streambp_core.models.catalogue import model_file, refusal, serving
from streambp_core.models.families import SUPPORTED_FAMILIES, TEXT_WRAPPERS
from streambp_core.models.known_names import ACTIVATIONS, ROPE_TYPES, rope_types, transformers_names

if TYPE_CHECKING:
    from transformers import PretrainedConfig

try:
    from huggingface_hub.errors import StrictDataclassError

    _VALIDATION_ERRORS: tuple[type[Exception], ...] = (StrictDataclassError,)
except ImportError:  # huggingface_hub before strict dataclasses: transformers raises ValueError/TypeError
    _VALIDATION_ERRORS = ()

ENGINE_LAYER_TYPES = ("full_attention", "sliding_attention")
CHUNKED_LAYER_FAMILIES = ("llama4_text",)
"""Families whose `chunked_attention` layers the engine runs (Llama 4's chunked local attention)."""
"""`config.layer_types` entries the engine has an attention for (which windows a family may use is
decided by `streambp_core.models.adapters`)."""
LINEAR_ATTENTION_FAMILIES = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_next")
"""`model_type`s whose `linear_attention` layers the engine runs (Gated DeltaNet: Qwen3.5, Qwen3-Next)."""

POSITIVE_SIZES = (
    "num_hidden_layers", "hidden_size", "num_attention_heads", "vocab_size", "intermediate_size",
)  # fmt: skip
"""Config sizes that must be positive integers when present."""


def config_from_values(values: dict, source: str) -> PretrainedConfig:
    """A transformers config from config.json's values, or ConfigError naming `source` and the problem."""
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    values = text_model_values(values, source)
    model_type = values.get("model_type")
    if model_type is None:
        raise ConfigError(f"{source}: no model_type (config.json must name its architecture)")
    if not isinstance(model_type, str) or model_type not in CONFIG_MAPPING:
        raise ConfigError(f"{source}: unknown model_type {model_type!r} (no architecture of that name)")
    try:
        config = CONFIG_MAPPING[model_type].from_dict(values)
    except (TypeError, ValueError, KeyError, AttributeError, *_VALIDATION_ERRORS) as error:
        raise ConfigError(f"{source}: invalid {model_type} config: {' '.join(str(error).split())}") from None
    check_geometry(config, source)
    return config


def text_model_values(values: dict, source: str) -> dict:
    """config.json's values of the model the engine runs: a multimodal wrapper's text model (`TEXT_WRAPPERS`:
    gemma3's `text_config`, its model_type filled in, tied to the embeddings as the wrapper says, as
    transformers ties the wrapper's head), else `values` themselves; ConfigError naming `source` when the
    wrapper has no text_config of its text family."""
    wrapper = values.get("model_type")
    text_type = dict(TEXT_WRAPPERS).get(wrapper) if isinstance(wrapper, str) else None
    if text_type is None:
        return values
    text = values.get("text_config")
    if not isinstance(text, dict):
        raise ConfigError(f"{source}: a {wrapper} config.json needs a text_config object (its {text_type} "
                          "text model is what the engine runs)")
    text = {"model_type": text_type, **text}
    if text["model_type"] != text_type:
        raise ConfigError(f"{source}: the text_config of a {wrapper} config.json must be {text_type}, got "
                          f"{text['model_type']!r}")
    return {**text, "tie_word_embeddings": values.get("tie_word_embeddings", True)}


def precheck_model(name: str) -> str:
    """The model `name` names, found (`catalogue.model_file`: a preset or a local directory with
    config.json), then on its config.json the checks that need no transformers (JSON, a family a path
    serves, geometry, activation and RoPE names): a broken one is refused in well under a second, before
    torch is imported; the rest is checked when the config is loaded."""
    found = model_file(name)
    precheck_values(found.values, found.preset or str(found.file))
    return name


def precheck_values(values: dict, source: str) -> None:
    """The geometry checks that need no transformers (so bad input is refused in well under a second),
    on config.json's raw values (a multimodal wrapper's text model's, `text_model_values`): `check_geometry`
    runs in full once the config is built."""
    values = text_model_values(values, source)
    _check_model_type(values.get("model_type"), source)
    raw = SimpleNamespace(**values)
    for name in (*POSITIVE_SIZES, *OPTIONAL_POSITIVE_SIZES):
        value = getattr(raw, name, None)
        if value is not None and not _is_positive_int(value) and not _per_layer(raw, name, value):
            raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
    if _is_positive_int(getattr(raw, "num_attention_heads", None)) and _is_positive_int(
            getattr(raw, "hidden_size", None)):
        _check_heads(raw, source)
    _check_linear_heads(raw, source)
    _check_experts(raw, source)
    _check_pad_token(raw, source)
    _check_activation(raw, source)
    _check_rope_types(raw, source)
    _check_layer_types(raw, source)


def _check_model_type(model_type: object, source: str) -> None:
    """ConfigError unless config.json names (`model_type`) a family a path serves (`models.catalogue`)."""
    if model_type is None:
        raise ConfigError(f"{source}: no model_type (config.json must name its architecture)")
    if not isinstance(model_type, str):
        raise ConfigError(f"{source}: unknown model_type {model_type!r} (no architecture of that name)")
    tier = serving(model_type)
    if tier.path == "refused":
        raise ConfigError(f"{source}: {refusal(model_type, tier.reason)}")


def check_geometry(config: PretrainedConfig, source: str) -> None:
    """ConfigError, naming the key, unless the config describes a model that can run: positive sizes,
    query heads a multiple of K/V heads, an even head size (RoPE rotates halves), experts per token
    within the expert count, a known activation, and a window for every sliding layer. The one check
    behind every command (`load_config`, `build_model`), run before any model is built."""
    for name in (*POSITIVE_SIZES, *OPTIONAL_POSITIVE_SIZES):
        value = _attr(config, name)
        if value is not None and not _is_positive_int(value) and not _per_layer(config, name, value):
            raise ConfigError(f"{source}: {name} must be a positive integer, got {value!r}")
    _check_heads(config, source)
    _check_linear_heads(config, source)
    _check_experts(config, source)
    _check_pad_token(config, source)
    _check_activation(config, source)
    _check_rope(config, source)
    _check_rope_types(config, source)
    _check_layer_types(config, source)


OPTIONAL_POSITIVE_SIZES = (
    "num_key_value_heads", "head_dim", "moe_intermediate_size", "decoder_sparse_step", "num_experts",
    "num_local_experts", "query_pre_attn_scalar", "linear_num_key_heads", "linear_num_value_heads",
    "linear_key_head_dim", "linear_value_head_dim", "linear_conv_kernel_dim",
)  # fmt: skip
"""Config sizes that must be positive when set (None: transformers derives or skips them)."""


def _attr(config: object, name: str) -> object:
    """The attribute `name` of `config`, or None where it has none or will not say (transformers raises,
    for one, on a per-layer size read globally: Gemma 4's `head_dim`)."""
    try:
        return getattr(config, name, None)
    except Exception:  # noqa: BLE001 (any refusal to answer is "not set" to these checks)
        return None


def _per_layer(config: PretrainedConfig | SimpleNamespace, name: str, value: object) -> bool:
    """Whether `value` is a per-layer `intermediate_size` (one positive size per decoder layer, as Gemma 3n's
    config gives it) of a family transformers' own layers run (`catalogue`: the baselines tier; the engine's
    layer math takes one size)."""
    return (name == "intermediate_size" and serving(config.model_type).path == "baselines"
            and isinstance(value, list | tuple) and len(value) == _attr(config, "num_hidden_layers")
            and all(_is_positive_int(size) for size in value))


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _check_heads(config: PretrainedConfig, source: str) -> None:
    heads = _attr(config, "num_attention_heads")
    if not heads:
        return
    kv_heads = _attr(config, "num_key_value_heads")
    kv_heads = heads if kv_heads is None else kv_heads
    if heads % kv_heads:
        raise ConfigError(
            f"{source}: num_attention_heads {heads} is not a multiple of num_key_value_heads {kv_heads!r}"
        )
    head_dim = _attr(config, "head_dim") or config.hidden_size // heads
    if head_dim < 2 or head_dim % 2:
        raise ConfigError(
            f"{source}: head_dim must be an even number of at least 2 (RoPE rotates pairs), got {head_dim}"
        )


def _check_linear_heads(config: PretrainedConfig | SimpleNamespace, source: str) -> None:
    """ConfigError unless each Gated DeltaNet key head serves a whole number of value heads (Qwen3.5,
    Qwen3-Next: transformers repeats each key head linear_num_value_heads / linear_num_key_heads times)."""
    keys = getattr(config, "linear_num_key_heads", None)
    values = getattr(config, "linear_num_value_heads", None)
    if _is_positive_int(keys) and _is_positive_int(values) and values % keys:
        raise ConfigError(f"{source}: linear_num_value_heads {values} is not a multiple of "
                          f"linear_num_key_heads {keys}")


def _check_experts(config: PretrainedConfig, source: str) -> None:
    experts = _attr(config, "num_experts") or _attr(config, "num_local_experts")
    per_token = _attr(config, "num_experts_per_tok")
    if not _is_positive_int(experts) or per_token is None:
        return
    if not _is_positive_int(per_token) or per_token > experts:
        raise ConfigError(
            f"{source}: num_experts_per_tok must be between 1 and the {experts} experts, got {per_token!r}"
        )


def _check_pad_token(config: PretrainedConfig | SimpleNamespace, source: str) -> None:
    """ConfigError unless `pad_token_id` (the embedding's padding row) is a row of the vocabulary (torch
    asserts it when the embedding is built)."""
    pad, vocab = _attr(config, "pad_token_id"), _attr(config, "vocab_size")
    if pad is None or not _is_positive_int(vocab):
        return
    if not isinstance(pad, int) or isinstance(pad, bool) or not 0 <= pad < vocab:
        raise ConfigError(f"{source}: pad_token_id must be a token id below vocab_size {vocab}, got {pad!r}")


def _check_activation(config: PretrainedConfig | SimpleNamespace, source: str) -> None:
    known = transformers_names(ACTIVATIONS)
    if known is None:  # a transformers that spells the table otherwise: ask it
        from transformers.activations import ACT2FN

        known = frozenset(ACT2FN)
    for name in ("hidden_act", "hidden_activation"):
        value = _attr(config, name)
        if value is not None and (not isinstance(value, str) or value not in known):
            raise ConfigError(f"{source}: {name} {value!r} is not an activation transformers knows")


def _check_rope_types(config: PretrainedConfig | SimpleNamespace, source: str) -> None:
    """ConfigError unless every RoPE table's `rope_type` is one transformers has (an unknown one is a
    KeyError inside transformers when the model is built)."""
    known = transformers_names(ROPE_TYPES)
    if known is None:
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

        known = frozenset(ROPE_INIT_FUNCTIONS)
    for rope_type in rope_types(vars(config) if isinstance(config, SimpleNamespace) else config):
        if not isinstance(rope_type, str) or rope_type not in {"default", *known}:
            raise ConfigError(f"{source}: rope_type {rope_type!r} is not one transformers knows "
                              f"(default, {', '.join(sorted(known))})")


def _check_rope(config: PretrainedConfig, source: str) -> None:
    parameters = _attr(config, "rope_parameters") or {}
    tables = [table for table in parameters.values() if isinstance(table, dict)] or [parameters]
    for table in tables:
        theta = table.get("rope_theta")
        number = isinstance(theta, int | float) and not isinstance(theta, bool)
        if theta is not None and (not number or theta <= 0):
            raise ConfigError(f"{source}: rope_theta must be a positive number, got {theta!r}")


def _check_layer_types(config: PretrainedConfig, source: str) -> None:
    window = _attr(config, "sliding_window")
    switched_off = _attr(config, "use_sliding_window") is False
    unused = switched_off and window == 0  # Qwen2-MoE's config writes 0 when the window is switched off
    if window is not None and not unused and not _is_positive_int(window):
        raise ConfigError(f"{source}: sliding_window must be a positive integer or null, got {window!r}")
    layer_types = _attr(config, "layer_types")
    if not isinstance(layer_types, list | tuple):  # None; anything else transformers refuses by name
        return
    model_type = _attr(config, "model_type")
    if model_type not in SUPPORTED_FAMILIES:  # the baselines tier: transformers' own layers run its types
        return
    runs = (*ENGINE_LAYER_TYPES, *(("chunked_attention",) if model_type in CHUNKED_LAYER_FAMILIES else ()),
            *(("linear_attention",) if model_type in LINEAR_ATTENTION_FAMILIES else ()))
    unknown = sorted({str(kind) for kind in layer_types} - set(runs))
    if unknown:
        raise ConfigError(
            f"{source}: layer_types {', '.join(unknown)} not supported by the engine "
            f"(it runs {' and '.join(runs)})"
        )
    size = _attr(config, "attention_chunk_size")
    if "chunked_attention" in layer_types and not _is_positive_int(size):  # only where `runs` has it
        raise ConfigError(f"{source}: layer_types names chunked_attention but attention_chunk_size is "
                          f"{size!r}, not a positive integer")
    if "sliding_attention" in layer_types and (window is None or switched_off):
        why = " (use_sliding_window is false)" if switched_off else ""
        raise ConfigError(
            f"{source}: layer_types names sliding_attention but the config has no sliding_window{why}; "
            "set sliding_window or make those layers full_attention"
        )
