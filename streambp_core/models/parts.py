"""The records the engine reads a decoder through (`models.adapters` fills them per family): `LayerParts`
for one decoder layer (projections, norms, MLP, and what sets its family apart), `FusedRows` for a row
range of a fused projection, `MlaParts` and `DeltaParts` for latent attention and Gated DeltaNet layers,
`DecoderParts` for the whole stack; and the layer-type names the configs use."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streambp_core.models.families import family_of

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
