"""DeepSeek-V4's float32 pieces, widened in a float64 model.

transformers keeps V4's hyper-connections, norms, attention sinks and compressor position biases in float32
(`_keep_in_fp32_modules_strict`) and computes them, its rotary angles and its compressor's gate softmax in
float32 (`.float()`, `.to(torch.float32)`, `softmax(..., dtype=torch.float32)`) whatever the model's
precision. In a float64 model each of those rounds to float32 on every layer, sliding ones included, and
their weights' gradients are float32 sums, so no chunked recompute can match the model's own backward
beyond float32's accuracy. `v4_in_at_least_float32` gives a float64 V4:
1. with `widen` (`streambp_core.models.load.build_model`), those parameters and the rotary tables in float64
   (float32 values widen exactly), as a float64 model's other parameters are;
2. its attention (compressor, indexer and rotary included), hyper-connections, hyper-head, norms and rotary
   embedding a forward that runs transformers' own under `wide_casts.WideFloat32Casts`: each float32 cast of
   a float64 tensor keeps float64, the math step for step transformers'. A module that still holds a float32
   parameter (a user's own model, built without `build_model` and not widened) keeps transformers' forward:
   its float32 weights would meet float64 inputs in one matmul.
A model of another precision, or of another family, is left as it is. streambp refuses a float64 V4 that still
holds float32 pieces (`float32_pieces`): its chunks, recomputed in float32 there, match plain to float32's
accuracy only.
"""

from __future__ import annotations

import types

import torch
from torch import nn

from streambp_core.models.wide_casts import forward_under_wide_casts

V4_WIDE_FORWARDS = ("DeepseekV4Attention", "DeepseekV4HyperConnection", "DeepseekV4HyperHead",
                    "DeepseekV4RMSNorm", "DeepseekV4UnweightedRMSNorm", "DeepseekV4RotaryEmbedding")
"""Class names of DeepSeek-V4's modules that compute in float32 (module docstring, step 2)."""


def v4_in_at_least_float32(model: nn.Module, dtype: torch.dtype, widen: bool) -> list[nn.Module]:
    """In a DeepSeek-V4 of precision float64 (`dtype`), the module docstring's steps (with `widen`, step 1
    too); returns the modules whose forward changed (`precision.restore_forwards` undoes them)."""
    if dtype != torch.float64 or getattr(getattr(model, "config", None), "model_type", None) != "deepseek_v4":
        return []
    if widen:
        model.to(torch.float64)  # floating parameters and buffers only; tid2eid stays int64
    changed = []
    for module in model.modules():
        if type(module).__name__ not in V4_WIDE_FORWARDS or "forward" in vars(module):
            continue
        if any(p.dtype != torch.float64 for p in module.parameters()):
            continue
        module.forward = types.MethodType(forward_under_wide_casts, module)
        changed.append(module)
    return changed


def float32_pieces(model: nn.Module) -> list[str]:
    """The names of a float64 DeepSeek-V4's parameters that are float32 (transformers keeps them so; step 1
    of the module docstring widens them); [] for any other model."""
    named = list(model.named_parameters())
    if getattr(getattr(model, "config", None), "model_type", None) != "deepseek_v4" \
            or not any(p.dtype == torch.float64 for _, p in named):
        return []
    return [name for name, p in named if p.dtype == torch.float32]
