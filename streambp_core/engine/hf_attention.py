"""The engine's prefix attention as a transformers attention implementation, so the baselines can run the
same kernel as StreamBP (fair comparisons) and run on the meta device (simulation) without a T x T mask.

Under it, a baseline passes the attention mask as `{"full_attention": key_valid}`: transformers then
skips building its 4D mask and hands each layer the (B, T) key-validity tensor (or None) unchanged.
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

from torch import Tensor, nn

from streambp_core.engine.attention import prefix_attention

ENGINE_ATTENTION = "streambp_prefix"


def engine_attention_forward(
    module: nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    backend: str = "auto",
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' attention-function signature over `prefix_attention`; returns (B, T, H, hd).

    `backend` is the CUDA kernel choice (auto, sdpa, flash), bound when the function is registered.
    """
    if dropout:
        raise ValueError("the engine attention has no dropout; build the model with attention_dropout=0")
    if attention_mask is not None and attention_mask.dim() != 2:
        raise ValueError("the engine attention takes a (batch, seq_len) key mask, not a 4D mask")
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = prefix_attention(query, key, value, attention_mask, scale, backend)
    return out.transpose(1, 2), None


def register_engine_attention(backend: str = "auto") -> str:
    """Register the engine attention with `backend` with transformers (idempotent); returns its name."""
    from transformers import AttentionInterface

    # transformers treats an implementation whose name contains "flash" as a hub flash kernel to load,
    # so the flash backend registers as `..._fa`
    suffix = {"auto": "", "flash": "_fa"}.get(backend, f"_{backend}")
    name = f"{ENGINE_ATTENTION}{suffix}"
    AttentionInterface.register(name, functools.partial(engine_attention_forward, backend=backend))
    return name


@contextmanager
def engine_attention(model: nn.Module, backend: str = "auto"):
    """Within the block, `model` attends through the engine kernel; its own setting is restored after."""
    original = model.config._attn_implementation
    model.set_attn_implementation(register_engine_attention(backend))
    try:
        yield model
    finally:
        model.set_attn_implementation(original)


def engine_mask_argument(key_valid: Tensor | None) -> dict[str, Tensor | None]:
    """The attention-mask argument that makes transformers pass `key_valid` straight to each layer."""
    return {"full_attention": key_valid}
