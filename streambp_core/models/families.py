"""The decoder families the engine runs: one table, with no torch or transformers import, so the CLI can
refuse a model of another architecture before it imports either (`config_file.precheck_model`)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Family:
    """One decoder family the engine runs."""

    model_type: str
    """transformers' `config.model_type`."""
    tiny: str
    """Its test model, the preset `tiny/<tiny>` (2 layers, hidden 64, vocab 512)."""
    gated_mlp: str | None
    """Class name of its MLP when that is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (the engine
    then takes the down projection's backward by hand; Phi-3's has gate and up as the halves of one
    gate_up_proj); None for a mixture-of-experts MLP or one of `other_mlp`."""
    other_mlp: str | None = None
    """Class name of a dense MLP of another form, run as a module under autograd (Apertus' ungated xIELU
    MLP, GLM-4's fused gate_up_proj); None: the MLP is `gated_mlp`'s, or a mixture of experts."""
    norms: tuple[str | None, str | None, str | None, str | None] = (
        "input_layernorm", "post_attention_layernorm", None, None)
    """Attribute names of the layer's norms: before attention, before the MLP, of the attention output
    and of the MLP output before their residuals (None: no norm there)."""
    qk_norms: tuple[str, str] = ("q_norm", "k_norm")
    """Attribute names of the attention's per-head norms of Q and K, where it has them."""
    qk_norm_after_rope: bool = False
    """Whether Q and K are normed after RoPE rather than before (HunYuan)."""
    rope_interleaved: bool = False
    """Whether RoPE rotates adjacent pairs (2i, 2i + 1) rather than the two halves (GLM-4, ERNIE 4.5)."""
    rope_in_float32: bool = False
    """Whether RoPE computes in float32 whatever the model's precision, with float32 tables (ERNIE 4.5)."""
    global_nope: bool = False
    """Whether the full-attention layers of a model with a sliding window leave Q and K unrotated
    (EXAONE 4's hybrid attention)."""
    rope_half_tables: bool = False
    """Whether its rotary embedding returns cos/sin for half the rotated features (each pair's angle
    once), which it applies to both halves (gpt-oss)."""
    sdpa: bool = True
    """Whether transformers runs its attention through SDPA; gpt-oss's has none (its sinks need eager
    attention or a kernel that takes them), nor Gemma 2's (SDPA has no soft-cap), so their models are built
    with eager attention."""
    rope_complex: bool = False
    """Whether RoPE multiplies adjacent pairs as complex numbers in float32 by a complex table (Llama 4's
    `apply_rotary_emb` over `freqs_cis`)."""
    mlp: str = "mlp"
    """Attribute name of the layer's MLP (Llama 4's `feed_forward`)."""
    router: str = "gate"
    """Attribute name of a mixture-of-experts MLP's router (Llama 4's and gpt-oss's `router`)."""
    moe_output_pair: bool = False
    """Whether a mixture-of-experts MLP returns (hidden states, router logits), which its layer unpacks
    (Llama 4, gpt-oss)."""
    attn_output_gate: bool = False
    """Whether q_proj also projects a gate per head, [query, gate] per head, and the attention output is
    multiplied by its sigmoid before o_proj (Qwen3.5's gated attention)."""

    @property
    def experts(self) -> bool:
        """Whether its MLP routes each token to experts (mixture of experts)."""
        return self.gated_mlp is None and self.other_mlp is None


OUTPUT_NORMS_ONLY = (None, None, "post_attention_layernorm", "post_feedforward_layernorm")
"""`Family.norms` of a layer that norms only the attention and MLP outputs before their residuals (OLMo 2
and 3, EXAONE 4)."""

FAMILIES = (
    Family("llama", "llama", "LlamaMLP"),
    Family("mistral", "mistral", "MistralMLP"),
    Family("qwen2", "qwen2", "Qwen2MLP"),
    Family("qwen3", "qwen3", "Qwen3MLP"),
    Family("gemma3_text", "gemma3", "Gemma3MLP",
           norms=("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                  "post_feedforward_layernorm")),
    Family("gemma2", "gemma2", "Gemma2MLP", sdpa=False,
           norms=("input_layernorm", "pre_feedforward_layernorm", "post_attention_layernorm",
                  "post_feedforward_layernorm")),
    Family("seed_oss", "seed-oss", "SeedOssMLP"),
    Family("smollm3", "smollm3", "SmolLM3MLP"),
    Family("granite", "granite", "GraniteMLP"),
    Family("olmo2", "olmo2", "Olmo2MLP", norms=OUTPUT_NORMS_ONLY),
    Family("olmo3", "olmo3", "Olmo3MLP", norms=OUTPUT_NORMS_ONLY),
    Family("phi3", "phi3", "Phi3MLP"),
    Family("hunyuan_v1_dense", "hunyuan", "HunYuanDenseV1MLP", qk_norms=("query_layernorm", "key_layernorm"),
           qk_norm_after_rope=True),
    Family("apertus", "apertus", None, other_mlp="ApertusMLP",
           norms=("attention_layernorm", "feedforward_layernorm", None, None)),
    Family("ernie4_5", "ernie4.5", "Ernie4_5MLP", rope_interleaved=True, rope_in_float32=True),
    Family("exaone4", "exaone4", "Exaone4MLP", global_nope=True, norms=OUTPUT_NORMS_ONLY),
    Family("glm4", "glm4", None, other_mlp="Glm4MLP", rope_interleaved=True, norms=(
        "input_layernorm", "post_attention_layernorm", "post_self_attn_layernorm", "post_mlp_layernorm")),
    Family("qwen3_moe", "qwen3-moe", None),
    Family("mixtral", "mixtral", None),
    Family("qwen2_moe", "qwen2-moe", None),
    Family("glm4_moe", "glm4-moe", None),
    Family("deepseek_v3", "deepseek-v3", None),
    Family("gpt_oss", "gpt-oss", None, rope_half_tables=True, router="router", moe_output_pair=True,
           sdpa=False),
    Family("llama4_text", "llama4", None, qk_norms=("qk_norm", "qk_norm"), qk_norm_after_rope=True,
           rope_complex=True, mlp="feed_forward", router="router", moe_output_pair=True),
    Family("qwen3_5_text", "qwen3.5", "Qwen3_5MLP", attn_output_gate=True),
    Family("qwen3_5_moe_text", "qwen3.5-moe", None, attn_output_gate=True),
    Family("qwen3_next", "qwen3-next", None, attn_output_gate=True),
)
"""The one table of decoder families: every other list of families derives from it."""
SUPPORTED_FAMILIES = tuple(family.model_type for family in FAMILIES)
"""`model_type`s of the decoder families the engine supports."""
TINY_FAMILIES = tuple(family.tiny for family in FAMILIES)
"""Names of the tiny test presets, one per family (`tiny/<name>`)."""
MOE_FAMILIES = tuple(family.model_type for family in FAMILIES if family.experts)
"""`model_type`s whose MLP is a mixture of experts."""
GATED_MLP_CLASSES = tuple(family.gated_mlp for family in FAMILIES if family.gated_mlp is not None)
"""MLP classes whose forward is exactly down_proj(act_fn(gate_proj(x)) * up_proj(x)) (gate and up fused in
Phi-3's)."""


TEXT_WRAPPERS = (("gemma3", "gemma3_text"), ("qwen3_5", "qwen3_5_text"), ("qwen3_5_moe", "qwen3_5_moe_text"))
"""(model_type, its text model's model_type) of multimodal configs whose `text_config` is a family the engine
runs: a directory with such a config.json loads as that text model (Gemma 3's `Gemma3Config`, Qwen3.5's
published `Qwen3_5Config` and `Qwen3_5MoeConfig`); the multimodal model itself is refused by name."""
TEXT_MODEL_CLASSES = {"gemma3": "Gemma3ForCausalLM", "qwen3_5": "Qwen3_5ForCausalLM",
                      "qwen3_5_moe": "Qwen3_5MoeForCausalLM"}
"""The `*ForCausalLM` class of each wrapper's text model (what a user loads instead of the multimodal one)."""


def family_of(model_type: str) -> Family:
    """The row of `FAMILIES` of a supported `model_type` (KeyError for another)."""
    for family in FAMILIES:
        if family.model_type == model_type:
            return family
    raise KeyError(model_type)
