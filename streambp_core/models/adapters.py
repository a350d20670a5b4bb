"""One adapter per decoder family: where a layer keeps its projections, norms and MLP.

Llama, Qwen2, Qwen3 and Mistral share one layer shape in transformers 5
(pre-norm attention with RoPE, then pre-norm gated MLP); Qwen3 adds per-head RMSNorm on Q and K.
The engine reads modules through `LayerParts`, so LoRA-wrapped projections (peft) work unchanged.
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from streambp_core.config import ConfigError

SUPPORTED_FAMILIES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LayerParts:
    """The sub-modules of one decoder layer that the engine calls, plus its attention geometry."""

    input_norm: nn.Module
    post_norm: nn.Module
    q_proj: nn.Module
    k_proj: nn.Module
    v_proj: nn.Module
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    mlp: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float


@dataclass(frozen=True)
class DecoderParts:
    """The pieces of a `*ForCausalLM` the methods drive: backbone (the decoder stack with its final norm),
    embedding, layers, final norm, head, rotary embedding."""

    backbone: nn.Module
    embed: nn.Module
    layers: nn.ModuleList
    norm: nn.Module
    lm_head: nn.Module
    rotary: nn.Module
    family: str


def model_family(config) -> str:
    """The decoder family of a transformers config, or ConfigError naming the supported ones."""
    family = getattr(config, "model_type", None)
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(
            f"unsupported architecture {family!r}; supported families: {', '.join(SUPPORTED_FAMILIES)}"
        )
    window = getattr(config, "sliding_window", None)
    uses_window = getattr(config, "use_sliding_window", None)
    if uses_window is None:
        uses_window = family == "mistral"
    if window is not None and uses_window:
        raise ConfigError(f"sliding-window attention (window {window}) is not supported by the engine")
    return family


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate the decoder pieces of a causal LM (plain or wrapped by peft)."""
    base = _unwrap_peft(model)
    family = model_family(base.config)
    inner = base.model
    return DecoderParts(
        backbone=inner,
        embed=inner.embed_tokens,
        layers=inner.layers,
        norm=inner.norm,
        lm_head=base.lm_head,
        rotary=inner.rotary_emb,
        family=family,
    )


def layer_parts(layer: nn.Module) -> LayerParts:
    """The sub-modules and attention geometry of one decoder layer."""
    attn = layer.self_attn
    config = attn.config
    head_dim = attn.head_dim
    return LayerParts(
        input_norm=layer.input_layernorm,
        post_norm=layer.post_attention_layernorm,
        q_proj=attn.q_proj,
        k_proj=attn.k_proj,
        v_proj=attn.v_proj,
        o_proj=attn.o_proj,
        q_norm=getattr(attn, "q_norm", None),
        k_norm=getattr(attn, "k_norm", None),
        mlp=layer.mlp,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=head_dim,
        scaling=attn.scaling,
    )


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (PeftModel -> LoraModel -> *ForCausalLM)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
