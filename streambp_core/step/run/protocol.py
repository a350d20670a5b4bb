"""Step protocols for memory figures: this project's own step, or the paper's measurement script.

- "default": the step `streambp_core.prepare(...)` runs: `run.loss(...)` keeps only the loss, and the
  transformers-driven baselines attend through the engine kernel with K/V at the KV-head count.
- "paper": the StreamBP reference script (`scripts/test_bp.py`) on transformers 4.51, as the paper's
  Fig. 3 measured it. Two differences matter for memory:
  1. it keeps the model's output object through backward (`output = model(...)`, then
     `output.loss.backward()`), so plain and checkpoint hold the bf16 logits, T x vocab x 2 bytes, during
     the whole backward;
  2. transformers 4.51's SDPA path expands grouped K/V to every query head (`repeat_kv`) before the
     kernel, and the kernel keeps the expanded copies for backward (`enable_gqa` came in July 2025).
  Not emulated: its 20% right padding (a (T, T) bf16 mask in 4.51, ~T^2 x 2 bytes: 0.75 GiB at 20k
  tokens), the CUDA context, and the caching allocator's fragmentation.
- "trl": the default step, with plain's and checkpoint's GRPO and DPO losses computed as TRL 0.17's
  trainers compute them (`StreamConfig.baseline_loss="trl"`, set by `StepSpec` from its protocol; see
  `streambp_core.methods.trl_loss`) and GRPOTrainer's default sampling temperature as an input. The
  paper's Table 3 ran those trainers. Nothing changes around the step, so this context does nothing.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

from torch import Tensor, nn

from streambp_core.config import PROTOCOLS, require_choice
from streambp_core.engine.attention.hf import engine_attention_forward
from streambp_core.methods.base import Run
from streambp_core.models.adapters import decoder_parts

REPEAT_KV_ATTENTION = "streambp_prefix_repeat_kv"


def check_protocol(protocol: str) -> str:
    """Return `protocol` if known, else raise ConfigError listing them."""
    require_choice("protocol", protocol, PROTOCOLS)
    return protocol


@contextmanager
def step_protocol(run: Run, protocol: str) -> Iterator[None]:
    """Within the block, `run` steps as `protocol` says (see the module docstring)."""
    if check_protocol(protocol) != "paper":
        yield
        return
    held: list[Tensor] = []
    handles = []
    if not run.drives_modules:  # its model forward returns the full logits (the output would hold them)
        lm_head = decoder_parts(run.model).lm_head
        handles.append(lm_head.register_forward_hook(lambda module, inputs, out: held.append(out)))
    original = run.model.config._attn_implementation
    expand = getattr(run, "uses_engine_attention", False)
    if expand:
        run.model.set_attn_implementation(_register_repeat_kv())
    try:
        yield
    finally:
        held.clear()
        for handle in handles:
            handle.remove()
        if expand:
            run.model.set_attn_implementation(original)


def repeat_kv_attention_forward(
    module: nn.Module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs
) -> tuple[Tensor, None]:
    """The engine attention after expanding K/V (B, Hkv, T, hd) to the query heads, as 4.51's SDPA."""
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        key, value = (t.repeat_interleave(groups, dim=1) for t in (key, value))
    return engine_attention_forward(module, query, key, value, attention_mask, **kwargs)


def _register_repeat_kv() -> str:
    from transformers import AttentionInterface

    AttentionInterface.register(REPEAT_KV_ATTENTION, repeat_kv_attention_forward)
    return REPEAT_KV_ATTENTION
