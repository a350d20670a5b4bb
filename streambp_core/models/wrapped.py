"""Weights of a multimodal wrapper's checkpoint (Gemma 3's `Gemma3ForConditionalGeneration`, Qwen3.5's
`Qwen3_5ForConditionalGeneration`) read into its text model, the `*ForCausalLM` the engine runs
(`families.TEXT_WRAPPERS`).

The wrapper's safetensors name the text model's weights `language_model.model.*` and
`language_model.lm_head.*` (Gemma 3's published checkpoints) or `model.language_model.*` and `lm_head.*`
(transformers' own module names, what it saves); the vision tower's and the projector's (Qwen3.5's
`model.visual.*` and its multi-token-prediction `mtp.*`) are left out. A weight of any other name, or one
the text model misses, is a ConfigError naming it, never a silently random weight (transformers'
`Gemma3ForCausalLM.from_pretrained` on such a directory initialises every weight afresh).
"""

from __future__ import annotations

from pathlib import Path

from torch import nn

from streambp_core.config import ConfigError

TEXT_PREFIXES = (
    ("language_model.model.", "model."),
    ("model.language_model.", "model."),
    ("language_model.lm_head.", "lm_head."),
    ("lm_head.", "lm_head."),
)
"""(prefix in the wrapper's checkpoint, the same weight's prefix in the text model)."""
OTHER_PREFIXES = (
    "vision_tower.", "model.vision_tower.", "multi_modal_projector.", "model.multi_modal_projector.",
    "model.visual.", "visual.", "mtp.",
)  # fmt: skip
"""Prefixes of the wrapper's weights that are not the text model's (left out): Gemma 3's vision tower and
projector, Qwen3.5's vision model and its multi-token-prediction layer (which the text model has not)."""


def text_key(key: str, source: str) -> str | None:
    """The text model's name of the wrapper checkpoint's weight `key`; None for the vision tower's and the
    projector's; ConfigError naming `source` for another."""
    for wrapped, text in TEXT_PREFIXES:
        if key.startswith(wrapped):
            return text + key.removeprefix(wrapped)
    if key.startswith(OTHER_PREFIXES):
        return None
    raise ConfigError(f"{source}: weight {key!r} is neither the text model's (language_model.*) nor the "
                      "vision tower's or projector's; cannot load it into the text model")


def load_wrapped_weights(model: nn.Module, path: str | Path) -> nn.Module:
    """`model` (the text model, built from the wrapper's text config) with the text weights of every
    safetensors file in `path`; ConfigError naming a weight the files lack (a tied head's excepted)."""
    from safetensors.torch import load_file

    state = {}
    for file in sorted(Path(path).glob("*.safetensors")):
        for key, tensor in load_file(file).items():
            name = text_key(key, str(file))
            if name is not None:
                state[name] = tensor
    missing, unexpected = model.load_state_dict(state, strict=False)
    tied = getattr(model.config, "tie_word_embeddings", False)
    missing = [name for name in missing if not (tied and name == "lm_head.weight")]
    if missing or unexpected:
        what = f"lacks {', '.join(missing[:3])}" if missing else f"has unknown {', '.join(unexpected[:3])}"
        raise ConfigError(f"{path}: the text model's weights do not match its config: the checkpoint {what}")
    return model
