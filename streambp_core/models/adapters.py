"""One adapter per decoder family: where a layer keeps its projections, norms and MLP.

Every supported family has one layer shape in transformers 5: norm, attention with RoPE, residual, norm,
MLP, residual. The differences are data in `LayerParts`:
- Qwen3, Qwen3-MoE and Gemma 3 add per-head RMSNorm on Q and K;
- Gemma 2 has Gemma 3's sandwich norms, query scale, embedding scale and GELU-tanh, one RoPE table, no q/k
  norms, sliding and full layers alternating (`layer_types`), and soft-caps the attention scores
  (cap * tanh(scores / cap) before the softmax, `attn_logit_softcapping`: `LayerParts.attn_softcap`) and
  the logits (`final_logit_softcapping`: `DecoderParts.final_softcap`);
- Gemma 3 adds sandwich norms (the attention and MLP outputs are normed before each residual), its own
  query scale (`query_pre_attn_scalar`), an embedding scale (inside its embedding module), GELU-tanh
  (inside its MLP), and separate RoPE tables for local and global layers;
- Mistral, Mixtral, Qwen2 (`use_sliding_window`), Qwen3 and Gemma 3 may attend through a sliding window,
  per layer as `config.layer_types` says (`sliding_attention` / `full_attention`);
- SmolLM3 leaves Q and K unrotated in its NoPE layers (`no_rope_layers[i]` = 0, every 4th layer);
- Seed-OSS may bias its output projection (`attention_out_bias`) and its MLP (`mlp_bias`);
- OLMo 2 and OLMo 3 norm only the attention and MLP outputs before each residual (no norm before
  either), and RMS-norm the whole projected Q and K (all heads at once, before the split into heads);
  OLMo 3 attends through a sliding window in 3 of every 4 layers (`layer_types`), with a RoPE table
  per layer type (its full layers may scale theirs: YaRN);
- Phi-3 projects Q, K and V in one `qkv_proj` (read as three `FusedRows`) and gate and up in one
  `gate_up_proj` (split in halves inside its MLP), and may turn only part of each head
  (`partial_rotary_factor`: the RoPE tables are narrower than the heads);
- Granite scales the embeddings (`embedding_multiplier`), the attention scores (`attention_multiplier`,
  its query scale), the attention and MLP outputs before each residual (`residual_multiplier`), and
  divides the logits by `logits_scaling`;
- HunYuan norms Q and K (`query_layernorm`, `key_layernorm`) after RoPE rather than before;
- Apertus names its norms `attention_layernorm` and `feedforward_layernorm`, norms Q and K, and its MLP is
  ungated, down_proj(xIELU(up_proj(x))), with the activation's own trainable parameters;
- ERNIE 4.5 rotates adjacent pairs (interleaved RoPE) in float32 whatever the model's precision;
- EXAONE 4 has no norm before attention or MLP, only after each (before its residual), norms Q and K, and
  in a hybrid model (`sliding_window` set) leaves its full-attention layers unrotated (NoPE);
- GLM-4 adds sandwich norms (`post_self_attn_layernorm`, `post_mlp_layernorm`), rotates adjacent pairs of
  the first `partial_rotary_factor` of each head (partial RoPE), and fuses gate and up (`gate_up_proj`);
- Qwen3-MoE and Mixtral route each token to experts inside the MLP module, which acts token by token;
  Qwen2-MoE adds a shared expert behind a sigmoid gate (`shared_expert_gate`), GLM-4.5 shared experts, a
  sigmoid router with group-limited top-k over scores + `e_score_correction_bias`, dense MLPs in its first
  `first_k_dense_replace` layers and halves-style partial RoPE; both route inside the module, the router
  still the block's `gate` (its logits first). Qwen2-MoE's sliding layers leave their window to the
  mask builder (`layer_window` reads it from `config.layer_types`).
- DeepSeek-V3 attends through multi-head latent attention (`MlaParts`: queries through q_a_proj,
  q_a_layernorm, q_b_proj or one q_proj; keys and values from one latent per position, kv_a_proj_with_mqa,
  kv_a_layernorm, kv_b_proj, plus one rotated key head shared by every head, qk head dim != v head dim;
  the engine keeps the latent, `engine.stream.mla`), and routes as GLM-4.5 does (sigmoid router,
  group-limited top-k, shared experts, dense first `first_k_dense_replace` layers).
- gpt-oss adds a learned attention sink per head (`sinks`: one more logit in every query row's softmax
  denominator, `engine.attention.sinks`), biases on q/k/v/o, sliding (`sliding_window`) and full layers
  as `layer_types` says, a rotary embedding whose tables hold each pair's angle once (`rope_half_tables`,
  YaRN-scaled), and routes inside its MLP (router `router` with a bias, softmax over the top-k logits,
  experts with an interleaved fused gate_up_proj, biases and a clamped SwiGLU), whose forward returns
  (output, router scores) (`mlp_pair`).
- Llama 4 (`llama4_text`) rotates adjacent pairs as complex numbers in float32 (`rope_complex`: its rotary
  embedding returns `freqs_cis`, kept as real and imaginary tables), L2-norms Q and K after RoPE in its
  RoPE layers (one weightless `qk_norm`), attends within chunks of `attention_chunk_size` positions in
  those layers (`attention_chunk`: `chunked_attention` in `config.layer_types`, counted from each row's
  first real token as transformers' mask does, `engine.chunks.LocalChunks`), leaves Q and K unrotated in
  its NoPE layers (`no_rope_layers[i]` 0), where it scales each query by a function of its index
  (`query_temperature`, `attn_temperature_tuning`), and names its MLP `feed_forward`: a mixture of experts
  (a sigmoid top-1 `router`, every token through every expert scaled by its score, a shared expert) that
  returns (hidden states, router logits) in the `moe_layers`, a dense gated MLP of `intermediate_size_mlp`
  elsewhere; its causal LM adds no router loss.
- Qwen3.5 alternates Gated DeltaNet linear-attention layers (`DeltaParts`: `config.layer_types` marks
  them `linear_attention`; a causal depthwise conv over the q/k/v projection, a gated delta-rule state
  per value head, a gated RMSNorm; the engine carries the state across chunks, `engine.stream.delta`)
  with gated full-attention layers (q_proj projects [query, gate] per head, the output is multiplied by
  the gate's sigmoid before o_proj: `attn_output_gate`), q/k norms and partial RoPE; its RMSNorms scale by
  (1 + weight). Qwen3.5-MoE's layers are the same, with Qwen2-MoE's routed MLP (a shared expert behind a
  sigmoid gate); Qwen3-Next's too, its linear attention projecting q, k, v, z and b, a through two fused
  projections (`in_proj_qkvz`, `in_proj_ba`), and its `mlp_only_layers` dense.
The engine reads modules through `LayerParts`, so LoRA-wrapped projections (peft) work unchanged.
"""

from __future__ import annotations

import sys

from torch import Tensor, nn

from streambp_core.config import ConfigError
from streambp_core.models.catalogue import refusal, serving
from streambp_core.models.families import (  # noqa: F401  (re-exported: the adapters' public names)
    FAMILIES,
    GATED_MLP_CLASSES,
    MOE_FAMILIES,
    SUPPORTED_FAMILIES,
    TEXT_MODEL_CLASSES,
    TINY_FAMILIES,
    Family,
    family_of,
)
from streambp_core.models.generic import generic_parts
from streambp_core.models.parts import (
    CHUNKED,
    ROPE_PER_LAYER_TYPE,
    SLIDING,
    SOFTCAPPED,
    WHOLE_QK_NORM,
    DecoderParts,
    DeltaParts,
    FusedRows,
    LayerParts,
    MlaParts,
)

_REFUSED = (
    ("attn_logit_softcapping", "attention logit soft-capping", SOFTCAPPED),
    ("final_logit_softcapping", "final logit soft-capping", SOFTCAPPED),
    ("use_bidirectional_attention", "bidirectional attention", ()),
    ("router_jitter_noise", "router jitter noise (random in training, so a recomputed chunk would differ)",
     ()),
)
"""Config features the engine cannot compute exactly: (attribute, what it is, the families it runs them
for), refused when set in any other family."""


def model_family(config) -> str:
    """The decoder family of a transformers config, or ConfigError naming the supported ones or the
    feature of this config that the engine cannot run exactly."""
    family = getattr(config, "model_type", None)
    if family in TEXT_MODEL_CLASSES:
        text = TEXT_MODEL_CLASSES[family]
        raise ConfigError(f"{family}: the multimodal model is not run by the engine; load its text model "
                          f"instead: {text}(config.text_config), or streambp_core.models.load_model(<dir>)")
    if family not in SUPPORTED_FAMILIES:
        raise ConfigError(refusal(family, "the engine's layer math does not run it (streambp takes its own "
                                  "decoder layers)" if serving(family).path == "baselines"
                                  else serving(family).reason))
    for attribute, feature, runs_it in _REFUSED:
        if family not in runs_it and getattr(config, attribute, None):
            raise ConfigError(f"{family}: {feature} is not supported by the engine ({attribute} is set)")
    return family


def decoder_parts(model: nn.Module) -> DecoderParts:
    """Locate the decoder pieces of a causal LM (plain or wrapped by peft)."""
    base = _unwrap_peft(model)
    if serving(getattr(base.config, "model_type", "")).path == "baselines":
        return DecoderParts(**generic_parts(base))
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
        embedding_multiplier=getattr(inner, "embedding_multiplier", 1.0),
        logits_scaling=getattr(base.config, "logits_scaling", 1.0) if family == "granite" else 1.0,
        final_softcap=base.config.final_logit_softcapping if family in SOFTCAPPED else None,
    )


def layer_parts(layer: nn.Module) -> LayerParts:
    """The sub-modules and attention geometry of one decoder layer."""
    if hasattr(layer, "linear_attn"):
        return _delta_layer_parts(layer)
    attn = layer.self_attn
    config = attn.config
    family = family_of(config.model_type)
    input_norm, post_norm, attn_out_norm, mlp_out_norm = (
        None if name is None else getattr(layer, name) for name in family.norms)
    q_norm, k_norm = (getattr(attn, name, None) for name in family.qk_norms)
    mlp = layer_mlp(layer)
    experts = hasattr(mlp, "experts")
    mla = _mla_parts(attn)
    q_proj, k_proj, v_proj = _qkv_projections(attn) if mla is None else (
        mla.q_proj or mla.q_b_proj, mla.kv_a_proj, mla.kv_b_proj)
    return LayerParts(
        input_norm=nn.Identity() if input_norm is None else input_norm,
        post_norm=nn.Identity() if post_norm is None else post_norm,
        q_proj=q_proj,
        k_proj=k_proj,
        v_proj=v_proj,
        o_proj=attn.o_proj,
        q_norm=q_norm,
        k_norm=k_norm,
        mlp=mlp,
        num_heads=config.num_attention_heads,
        num_kv_heads=config.num_key_value_heads,
        head_dim=getattr(attn, "qk_head_dim", None) or attn.head_dim,
        scaling=attn.scaling,
        attn_out_norm=attn_out_norm,
        mlp_out_norm=mlp_out_norm,
        sliding_window=layer_window(attn),
        rope_key=config.layer_types[attn.layer_idx] if config.model_type in ROPE_PER_LAYER_TYPE else None,
        rotary=layer_rotates(attn, family),
        qk_norm_after_rope=family.qk_norm_after_rope,
        rope_interleaved=family.rope_interleaved,
        rope_in_float32=family.rope_in_float32,
        residual_multiplier=getattr(layer, "residual_multiplier", 1.0),
        router=getattr(mlp, family.router) if experts else None,
        qk_norm_whole=config.model_type in WHOLE_QK_NORM,
        mla=mla,
        rope_complex=family.rope_complex,
        attention_chunk=layer_chunk(attn),
        query_temperature=query_temperature(attn),
        mlp_pair=family.moe_output_pair and experts,
        sink_module=attn if isinstance(getattr(attn, "sinks", None), Tensor) else None,
        attn_softcap=attn.attn_logit_softcapping if config.model_type in SOFTCAPPED else None,
        attn_output_gate=family.attn_output_gate,
    )


def layer_mlp(layer: nn.Module) -> nn.Module:
    """A decoder layer's MLP module (`mlp`, or the family's name for it: Llama 4's `feed_forward`; a
    Gated DeltaNet layer's, which has no `self_attn` to read the family from, is its `mlp`)."""
    if not hasattr(layer, "self_attn"):
        return layer.mlp
    return getattr(layer, family_of(layer.self_attn.config.model_type).mlp)


def layer_chunk(attn: nn.Module) -> int | None:
    """Positions per chunk of an attention module that attends within chunks (a `chunked_attention` layer
    of `config.layer_types`, Llama 4's RoPE layers: `attention_chunk_size`), else None."""
    config = attn.config
    layer_types = getattr(config, "layer_types", None)
    if layer_types is None or layer_types[attn.layer_idx] != CHUNKED:
        return None
    return config.attention_chunk_size


def query_temperature(attn: nn.Module) -> tuple[float, float] | None:
    """(floor_scale, attn_scale) of an attention module that scales its queries by their index (Llama 4's
    NoPE layers under `attn_temperature_tuning`), else None."""
    if not getattr(attn, "attn_temperature_tuning", False) or attn.use_rope:
        return None
    return attn.floor_scale, attn.attn_scale


def _delta_layer_parts(layer: nn.Module) -> LayerParts:
    """A Gated DeltaNet layer's parts: its norms and MLP as any layer's, its token mixer `DeltaParts`."""
    attn = layer.linear_attn
    modeling = sys.modules[type(attn).__module__]
    delta = DeltaParts(attn, modeling.torch_chunk_gated_delta_rule, modeling.causal_conv1d_fn)
    qkv = getattr(attn, "in_proj_qkv", None) or attn.in_proj_qkvz  # Qwen3-Next fuses z in
    return LayerParts(
        input_norm=layer.input_layernorm, post_norm=layer.post_attention_layernorm,
        q_proj=qkv, k_proj=qkv, v_proj=qkv, o_proj=attn.out_proj,
        q_norm=None, k_norm=None, mlp=layer.mlp, num_heads=attn.num_v_heads, num_kv_heads=attn.num_k_heads,
        head_dim=attn.head_k_dim, scaling=attn.head_k_dim ** -0.5, rotary=False, delta=delta,
        router=layer.mlp.gate if hasattr(layer.mlp, "experts") else None)


def _mla_parts(attn: nn.Module) -> MlaParts | None:
    """The latent attention's modules of a DeepSeek-V3 attention module, or None for another attention;
    ConfigError when its kv_b_proj is not a plain nn.Linear (a LoRA wrapper: the engine absorbs its
    weight)."""
    if not hasattr(attn, "kv_b_proj"):
        return None
    if type(attn.kv_b_proj) is not nn.Linear:
        raise ConfigError(f"{attn.config.model_type}: a wrapped kv_b_proj (LoRA) is not supported by the "
                          "engine, which absorbs its weight into the queries and outputs")
    return MlaParts(q_proj=attn.q_proj, q_a_proj=attn.q_a_proj, q_a_norm=attn.q_a_layernorm,
                    q_b_proj=attn.q_b_proj, kv_a_proj=attn.kv_a_proj_with_mqa, kv_a_norm=attn.kv_a_layernorm,
                    kv_b_proj=attn.kv_b_proj, nope_dim=attn.qk_nope_head_dim, rope_dim=attn.qk_rope_head_dim,
                    v_dim=attn.v_head_dim, latent_dim=attn.kv_lora_rank,
                    rope_interleave=bool(attn.config.rope_interleave))


def layer_rotates(attn: nn.Module, family: Family) -> bool:
    """Whether an attention module rotates Q and K: not in SmolLM3's NoPE layers (`use_rope` 0), nor in
    the full-attention layers of a hybrid EXAONE 4 (`global_nope`: a sliding window is set)."""
    if family.global_nope and attn.sliding_window is not None and not attn.is_sliding:
        return False
    return bool(getattr(attn, "use_rope", True))


def layer_window(attn: nn.Module) -> int | None:
    """The sliding window an attention module applies, as its transformers forward passes it: its own
    `sliding_window` (set per layer type), or, for a module that sets it in its sliding layers only
    (Qwen2-MoE), the config's in a `sliding_attention` layer of `config.layer_types`, or the config's for
    models with one window for every layer (Mistral, Mixtral); None in a layer that keeps the config's
    window but attends globally (`is_sliding` false: EXAONE 4's full-attention layers)."""
    if not getattr(attn, "is_sliding", True):
        return None
    if hasattr(attn, "sliding_window"):
        return attn.sliding_window
    layer_types = getattr(attn.config, "layer_types", None)
    if layer_types is not None and layer_types[attn.layer_idx] != SLIDING:
        return None
    return getattr(attn.config, "sliding_window", None)


def _qkv_projections(attn: nn.Module) -> tuple[nn.Module | FusedRows, ...]:
    """The q, k and v projections of an attention module: its own, or the rows of its fused `qkv_proj`
    (Phi-3: Q's, then K's, then V's features)."""
    if not hasattr(attn, "qkv_proj"):
        return attn.q_proj, attn.k_proj, attn.v_proj
    q_size = attn.config.num_attention_heads * attn.head_dim
    kv_size = attn.config.num_key_value_heads * attn.head_dim
    fused = attn.qkv_proj
    return (FusedRows(fused, 0, q_size), FusedRows(fused, q_size, q_size + kv_size),
            FusedRows(fused, q_size + kv_size, q_size + 2 * kv_size))


def _unwrap_peft(model: nn.Module) -> nn.Module:
    """The transformers model inside a peft wrapper (PeftModel -> LoraModel -> *ForCausalLM)."""
    get_base_model = getattr(model, "get_base_model", None)
    return get_base_model() if callable(get_base_model) else model
