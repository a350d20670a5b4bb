"""RAM a `verify` run needs on a CPU, checked before the model is built (a 32B model on a 16 GiB machine
is refused on one line instead of allocating until the machine dies)."""

from __future__ import annotations

import torch

from streambp_core.config import ConfigError
from streambp_core.measure import host_ram
from streambp_core.models import build_model

RAM_FRACTION = 0.8
"""verify may plan to use at most this fraction of the RAM available."""


def needed_ram_bytes(config, spec, dtype: torch.dtype) -> int:
    """A lower bound on the RAM a verify run holds at once: the weights, the reference's gradients and a
    method's gradients (parameters counted on the meta device; with LoRA the weights only), plus plain's
    float32 logits and their gradient for the whole batch."""
    model = build_model(config, dtype=dtype, device="meta", checked=True)  # `config` from load_config
    parameters = sum(param.numel() for param in model.parameters())
    logits = spec.step.batch_size * spec.step.seq_len_tokens * config.vocab_size
    copies = 1 if spec.step.lora_rank else 3
    return copies * parameters * dtype.itemsize + 2 * logits * 4


def check_ram(config, spec, dtype: torch.dtype, available_bytes: int | None = None) -> None:
    """ConfigError when `needed_ram_bytes` exceeds RAM_FRACTION of the RAM available."""
    available = host_ram.available_ram_bytes() if available_bytes is None else available_bytes
    need = needed_ram_bytes(config, spec, dtype)
    if need > RAM_FRACTION * available:
        raise ConfigError(
            f"verify of {spec.step.model} in {str(dtype).removeprefix('torch.')} needs at least "
            f"{need / 2**30:.1f} GiB of RAM (weights, gradients, logits); {available / 2**30:.1f} GiB "
            f"available, verify uses at most {RAM_FRACTION:.0%}: pick a smaller model or --device cuda"
        )
