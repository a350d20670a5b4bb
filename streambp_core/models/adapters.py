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
from collections.abc import Callable
from dataclasses import dataclass

import torch
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

SLIDING = "sliding_attention"
"""`config.layer_types` entry of a local (sliding-window) layer."""
CHUNKED = "chunked_attention"
"""`config.layer_types` entry of a layer that attends within chunks of positions (Llama 4's)."""
ROPE_PER_LAYER_TYPE = ("gemma3_text", "olmo3")
"""Families whose rotary embedding keeps one RoPE table per `config.layer_types` entry."""
SOFTCAPPED = ("gemma2",)
"""Families whose transformers code soft-caps the attention scores and the logits as their config says
(`attn_logit_softcapping`, `final_logit_softcapping`); the engine caps them likewise. Another family's
config that sets either is refused (Gemma 3's attention, for one, never passes its cap to the kernel)."""
WHOLE_QK_NORM = ("olmo2", "olmo3")
"""Families whose q/k norms act on the whole projection (all heads at once), not on each head."""


@dataclass(frozen=True)
class FusedRows:
    """Output features start..end of a fused projection (Phi-3's `qkv_proj`), as the engine's q, k or v
    projection. Of a bare nn.Linear it projects with those rows of the weight (and bias), so the
    gradient lands in the fused parameters' rows; any other module (a peft LoRA wrapper) projects the
    whole output and keeps the rows, so the wrapper's own forward and parameters take part."""

    fused: nn.Module
    start: int
    end: int

    @property
    def weight(self) -> Tensor:
        """Rows start..end of a fused nn.Linear's weight (a view)."""
        return self.fused.weight[self.start : self.end]

    @property
    def bias(self) -> Tensor | None:
        """Rows start..end of a fused nn.Linear's bias (a view), or None."""
        return None if self.fused.bias is None else self.fused.bias[self.start : self.end]

    def __call__(self, x: Tensor) -> Tensor:
        if type(self.fused) is nn.Linear:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        return self.fused(x)[..., self.start : self.end]


@dataclass(frozen=True)
class MlaParts:
    """The modules and sizes of a multi-head latent attention (DeepSeek-V3's `DeepseekV3Attention`)."""

    q_proj: nn.Module | None
    """The one query projection when `q_lora_rank` is None, else None (and q_a_proj, q_a_norm, q_b_proj)."""
    q_a_proj: nn.Module | None
    q_a_norm: nn.Module | None
    q_b_proj: nn.Module | None
    kv_a_proj: nn.Module
    """kv_a_proj_with_mqa: the latent (kv_lora_rank) and the shared rotary key (qk_rope_head_dim)."""
    kv_a_norm: nn.Module
    kv_b_proj: nn.Linear
    """The latent's up-projection to each head's k_nope and v, absorbed by the engine (a plain nn.Linear)."""
    nope_dim: int
    rope_dim: int
    v_dim: int
    latent_dim: int
    rope_interleave: bool

    def kv_b_weight(self) -> Tensor:
        """kv_b_proj's weight as (H, nope + v, latent): each head's W_uk rows, then its W_uv rows."""
        return self.kv_b_proj.weight.view(-1, self.nope_dim + self.v_dim, self.latent_dim)


@dataclass(frozen=True)
class DeltaParts:
    """A Gated DeltaNet linear attention (Qwen3.5's `Qwen3_5GatedDeltaNet`): its module (projections
    `in_proj_qkv`, `in_proj_z`, `in_proj_b`, `in_proj_a`, the depthwise `conv1d`, `A_log`, `dt_bias`, the
    gated `norm`, `out_proj`), and transformers' own functions for its conv and delta rule, read from the
    module's modeling file (so the same dispatch: the torch path, or a kernel package where one runs)."""

    module: nn.Module
    chunk_rule: Callable
    """transformers' `torch_chunk_gated_delta_rule` (q, k, v, g, beta, initial_state, output_final_state,
    use_qk_l2norm_in_kernel) -> (output, final state)."""
    conv: Callable
    """transformers' `causal_conv1d_fn` (x (B, C, L), weight (C, K), bias, activation) -> (B, C, L)."""

    @property
    def kernel_size(self) -> int:
        return self.module.conv_kernel_size

    @property
    def conv_dim(self) -> int:
        """Channels of the conv: q, k and v features of a position."""
        return self.module.conv_dim


@dataclass(frozen=True)
class LayerParts:
    """The sub-modules of one decoder layer that the engine calls, plus its attention geometry."""

    input_norm: nn.Module
    """The norm before attention (an identity for a family without one, EXAONE 4)."""
    post_norm: nn.Module
    """The norm before the MLP (an identity for a family without one)."""
    q_proj: nn.Module | FusedRows
    k_proj: nn.Module | FusedRows
    v_proj: nn.Module | FusedRows
    o_proj: nn.Module
    q_norm: nn.Module | None
    k_norm: nn.Module | None
    """Norms of Q and K before RoPE (each head's, or with `qk_norm_whole` all heads' at once), or None."""
    mlp: nn.Module
    num_heads: int
    num_kv_heads: int
    head_dim: int
    scaling: float
    attn_out_norm: nn.Module | None = None
    """Norm of the attention output before its residual (Gemma's sandwich norm, OLMo's post-norm), or None."""
    mlp_out_norm: nn.Module | None = None
    """Norm of the MLP output before its residual (Gemma's sandwich norm, OLMo's post-norm), or None."""
    sliding_window: int | None = None
    """Keys a query sees (itself included) in a local layer; None: the whole causal prefix."""
    rope_key: str | None = None
    """Which RoPE table the layer rotates with (Gemma 3: its layer type); None: the model's only one."""
    rotary: bool = True
    """Whether the layer rotates Q and K (False: a NoPE layer of SmolLM3's `no_rope_layers`, a global layer
    of a hybrid EXAONE 4)."""
    qk_norm_after_rope: bool = False
    """Whether `q_norm` and `k_norm` apply after RoPE (HunYuan) rather than before."""
    rope_interleaved: bool = False
    """Whether RoPE rotates adjacent pairs rather than halves (GLM-4, ERNIE 4.5)."""
    rope_in_float32: bool = False
    """Whether RoPE computes in float32 whatever the model's precision (ERNIE 4.5)."""
    residual_multiplier: float = 1.0
    """Scale of the attention and MLP outputs before each residual add (Granite's `residual_multiplier`)."""
    router: nn.Module | None = None
    """The router of a mixture-of-experts MLP (its `gate`, returning router logits first), or None."""
    qk_norm_whole: bool = False
    """Whether `q_norm` and `k_norm` norm all heads of a position together (OLMo 2 and 3), not each head."""
    mla: MlaParts | None = None
    """A multi-head latent attention's modules (DeepSeek-V3; q/k/v_proj then name its query, kv_a and
    kv_b projections, for reading only), or None."""
    sink_module: nn.Module | None = None
    """The attention module holding per-head attention sinks (gpt-oss's `sinks`), or None."""
    attn_softcap: float | None = None
    """The attention scores' soft-cap: scaled scores s become cap * tanh(s / cap) before the mask and the
    softmax (Gemma 2's `attn_logit_softcapping`); None: uncapped."""

    @property
    def sinks(self) -> Tensor | None:
        """The attention sinks (H,), read from the module when used (a sharded engine may swap the
        parameter between steps), or None."""
        return None if self.sink_module is None else self.sink_module.sinks

    rope_complex: bool = False
    """Whether RoPE multiplies adjacent pairs as complex numbers in float32 (Llama 4's `freqs_cis`)."""
    attention_chunk: int | None = None
    """Positions per chunk of a chunked local attention layer (Llama 4's `attention_chunk_size`): a query
    sees only the keys of its own chunk; None: no chunks."""
    query_temperature: tuple[float, float] | None = None
    """(floor_scale, attn_scale) of Llama 4's attention temperature tuning in a NoPE layer: the query at
    index t is scaled by log1p(floor((t + 1) / floor_scale)) * attn_scale + 1; None: unscaled."""
    mlp_pair: bool = False
    """Whether the MLP returns (hidden states, router logits) rather than hidden states (Llama 4's MoE)."""

    def feed_forward(self, x: Tensor) -> Tensor:
        """The MLP's output hidden states (B, c, d) for its input x (B, c, d), as the layer takes them (of a
        pair, the first, (B * c, d), viewed as x)."""
        out = self.mlp(x)
        return out[0].view(x.shape) if self.mlp_pair else out
    attn_output_gate: bool = False
    """Whether q_proj projects [query, gate] per head and the output is multiplied by sigmoid(gate) before
    o_proj (Qwen3.5)."""
    delta: DeltaParts | None = None
    """A Gated DeltaNet linear-attention layer's modules (Qwen3.5's `linear_attention` layers; q/k/v_proj
    then all name its in_proj_qkv, o_proj its out_proj, for reading only), or None."""

    def norm_heads(self, norm: nn.Module, t: Tensor) -> Tensor:
        """`norm` (q_norm or k_norm) applied to the heads t (B, c, heads, hd), as the family applies it."""
        return norm(t.flatten(2)).view_as(t) if self.qk_norm_whole else norm(t)


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
    embedding_multiplier: float = 1.0
    """Scale of the embeddings before the first layer (Granite's `embedding_multiplier`)."""
    logits_scaling: float = 1.0
    """The logits are the LM head's output divided by it (Granite's `logits_scaling`)."""
    final_softcap: float | None = None
    """The logits' soft-cap, cap * tanh(logits / cap) (Gemma 2's `final_logit_softcapping`); None: none."""

    def embed_tokens(self, input_ids: Tensor) -> Tensor:
        """The first layer's input (B, T, d): the embeddings of `input_ids`, scaled as the model does."""
        hidden = self.embed(input_ids)
        return hidden if self.embedding_multiplier == 1.0 else hidden * self.embedding_multiplier

    def rope_tables(self, hidden: Tensor, positions: Tensor) -> dict[str | None, tuple[Tensor, Tensor]]:
        """cos/sin of `positions` for every RoPE table the layers use, keyed as `LayerParts.rope_key`;
        tables of half the rotated features (gpt-oss's) repeated for both halves, as it applies them."""
        if family_of(self.family).rope_half_tables:
            cos, sin = self.rotary(hidden, positions)
            return {None: (torch.cat((cos, cos), dim=-1), torch.cat((sin, sin), dim=-1))}
        if self.family not in ROPE_PER_LAYER_TYPE:
            return {None: _cos_sin(self.rotary(hidden, positions))}
        return {kind: self.rotary(hidden, positions, kind) for kind in sorted(set(self.rotary.layer_types))}


def _cos_sin(table) -> tuple[Tensor, Tensor]:
    """A rotary embedding's (cos, sin), or for Llama 4's complex `freqs_cis` (B, T, hd / 2) its real and
    imaginary parts (`Rope.complex` multiplies by them as that complex number again)."""
    if isinstance(table, Tensor) and table.is_complex():
        return table.real, table.imag
    return table


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
