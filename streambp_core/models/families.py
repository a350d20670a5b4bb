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
    gate_up_proj); None for a mixture-of-experts MLP."""

    @property
    def experts(self) -> bool:
        """Whether its MLP routes each token to experts (mixture of experts)."""
        return self.gated_mlp is None


FAMILIES = (
    Family("llama", "llama", "LlamaMLP"),
    Family("mistral", "mistral", "MistralMLP"),
    Family("qwen2", "qwen2", "Qwen2MLP"),
    Family("qwen3", "qwen3", "Qwen3MLP"),
    Family("gemma3_text", "gemma3", "Gemma3MLP"),
    Family("seed_oss", "seed-oss", "SeedOssMLP"),
    Family("smollm3", "smollm3", "SmolLM3MLP"),
    Family("granite", "granite", "GraniteMLP"),
    Family("olmo2", "olmo2", "Olmo2MLP"),
    Family("olmo3", "olmo3", "Olmo3MLP"),
    Family("phi3", "phi3", "Phi3MLP"),
    Family("qwen3_moe", "qwen3-moe", None),
    Family("mixtral", "mixtral", None),
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
