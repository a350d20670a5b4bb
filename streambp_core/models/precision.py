"""Norms that keep a float64 model in float64.

Gemma 3's RMSNorm computes in `x.float()`, meant as an upcast for bfloat16; on a float64 model it rounds
every norm to float32, and its weight gradient becomes a float32 sum over all tokens, so the model's own
backward is float32-accurate and no float64 comparison of methods can reach 1e-10 on those weights.
`norms_in_at_least_float32` makes each such norm compute in the wider of float32 and its input precision:
for float32, float16 and bfloat16 inputs nothing changes; float64 stays float64.

GLM-4.5's router keeps its weight in float32 (`_keep_in_fp32_modules_strict`) and computes its logits from
`.type(torch.float32)` of input and weight: the same float32 island, whose weight gradient is a float32
sum. `routers_in_at_least_float32` gives such a router of a float64 model a float64 weight (float32 values
widen exactly) and float64 logits; the routing that follows is transformers' step for step. A model of
another precision keeps transformers' router untouched.

Qwen3.5 has three such islands: its RMSNorm (Gemma 3's form), the gated RMSNorm of its linear attention,
and the linear attention's decay and delta rule (`A_log.float()`, `a.float()`, and transformers'
`torch_chunk_gated_delta_rule` casting q, k, v, g and beta to float32). A float32 recurrence whose
weight gradients are float32 sums cannot be compared chunk by chunk to 1e-10 either, so
`hybrid_in_at_least_float32` gives each Gated DeltaNet of a float64 model a forward that runs
transformers' own forward under `WideFloat32Casts`: a cast of a float64 tensor to float32 keeps it
float64 (the math is transformers', step for step, only in float64). `build_model` applies it; every
prepared run applies it too for its duration (a user's own float64 model), and the engine's chunked
linear attention computes under the same casts exactly when the module does (`delta_casts`).
"""

from __future__ import annotations

import types
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.nn import functional as F
from torch.overrides import TorchFunctionMode

FLOAT32_NORMS = ("Gemma3RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm", "Qwen3NextRMSNorm")
"""Class names of norms that compute in `x.float()`."""


def _norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    work = torch.promote_types(x.dtype, torch.float32)
    return (self._norm(x.to(work)) * (1.0 + self.weight.to(work))).type_as(x)


def norms_in_at_least_float32(model: nn.Module) -> int:
    """Give every float32-only norm of `model` the at-least-float32 forward (instance-level, the class is
    untouched); returns how many norms changed."""
    changed = 0
    for module in model.modules():
        if type(module).__name__ in FLOAT32_NORMS and "forward" not in vars(module):
            module.forward = types.MethodType(_norm_in_at_least_float32, module)
            changed += 1
    return changed


FLOAT32_ROUTERS = ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter")
"""Class names of routers whose weight and logits are float32 whatever the model's precision."""


def _router_in_at_least_float32(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' `Glm4MoeTopkRouter.forward` (DeepSeek-V3's router is the same) with its logits in the
    wider of float32 and the input's precision: sigmoid scores; top-k experts of scores +
    e_score_correction_bias within the `topk_group` best groups (a group's score: its two best); their
    scores, normalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`, are the weights."""
    work = torch.promote_types(hidden_states.dtype, torch.float32)
    hidden_states = hidden_states.view(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(work), self.weight.to(work))  # (n, E)
    scores = router_logits.sigmoid()
    scores_for_choice = scores + self.e_score_correction_bias
    per_group = self.num_experts // self.num_group
    group_scores = scores_for_choice.view(-1, self.num_group, per_group).topk(2, dim=-1)[0].sum(dim=-1)
    group_idx = torch.topk(group_scores, k=self.topk_group, dim=-1, sorted=False)[1]
    group_mask = torch.zeros_like(group_scores)
    group_mask.scatter_(1, group_idx, 1)
    score_mask = group_mask.unsqueeze(-1).expand(-1, self.num_group, per_group).reshape(-1, self.num_experts)
    scores_for_choice = scores_for_choice.masked_fill(~score_mask.bool(), float("-inf"))
    topk_indices = torch.topk(scores_for_choice, k=self.top_k, dim=-1, sorted=False)[1]
    topk_weights = scores.gather(1, topk_indices)
    if self.norm_topk_prob:
        denominator = topk_weights.sum(dim=-1, keepdim=True) + 1e-20
        topk_weights /= denominator
    topk_weights = topk_weights * self.routed_scaling_factor
    return router_logits, topk_weights, topk_indices


def routers_in_at_least_float32(model: nn.Module, dtype: torch.dtype) -> int:
    """In a model of precision float64 (`dtype`), give every float32-only router a float64 weight and the
    at-least-float32 forward (instance-level, the class is untouched); a model of another precision is left
    as transformers builds it. Returns how many routers changed."""
    if dtype != torch.float64:
        return 0
    changed = 0
    for module in model.modules():
        if type(module).__name__ in FLOAT32_ROUTERS and "forward" not in vars(module):
            module.weight.data = module.weight.data.to(dtype)
            module.forward = types.MethodType(_router_in_at_least_float32, module)
            changed += 1
    return changed


FLOAT32_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet")
"""Class names of linear attentions whose decay, delta rule and gated norm compute in float32."""


class WideFloat32Casts(TorchFunctionMode):
    """Inside it, `t.float()` and `t.to(torch.float32, ...)` of a float64 tensor t keep float64; every
    other op (and every other cast) runs as it is. No effect on float32, float16 and bfloat16 tensors."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.float, Tensor.to) and args and isinstance(args[0], Tensor) \
                and args[0].dtype == torch.float64:
            if func is Tensor.float:
                return args[0]
            args = tuple(torch.float64 if a is torch.float32 else a for a in args)
            if kwargs.get("dtype") is torch.float32:
                kwargs = {**kwargs, "dtype": torch.float64}
        return func(*args, **kwargs)


def _delta_in_at_least_float32(self, *args, **kwargs):
    """transformers' forward of the linear attention, under `WideFloat32Casts`."""
    with WideFloat32Casts():
        return type(self).forward(self, *args, **kwargs)


def delta_casts(module: nn.Module) -> AbstractContextManager:
    """The casts a linear attention module's forward computes under: `WideFloat32Casts` once
    `hybrid_in_at_least_float32` gave it the at-least-float32 forward, else transformers' own."""
    forward = vars(module).get("forward")
    widened = getattr(forward, "__func__", None) is _delta_in_at_least_float32
    return WideFloat32Casts() if widened else nullcontext()


def hybrid_in_at_least_float32(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """In a model of precision float64 (`dtype`), give every float32-only norm (`FLOAT32_NORMS`) and linear
    attention (`FLOAT32_DELTA_NETS`) of a hybrid model (one with a linear attention) its at-least-float32
    forward (instance-level, the class is untouched); a model of another precision, or without a linear
    attention, is left as it is. Returns the modules changed (`restore_forwards` undoes it)."""
    if dtype != torch.float64:
        return []
    modules = list(model.modules())
    if not any(type(m).__name__ in FLOAT32_DELTA_NETS for m in modules):
        return []
    changed = []
    for module in modules:
        name = type(module).__name__
        if "forward" in vars(module) or name not in (*FLOAT32_NORMS, *FLOAT32_DELTA_NETS):
            continue
        forward = _delta_in_at_least_float32 if name in FLOAT32_DELTA_NETS else _norm_in_at_least_float32
        module.forward = types.MethodType(forward, module)
        changed.append(module)
    return changed


def restore_forwards(modules: list[nn.Module]) -> None:
    """Give `modules` their class's forward again (undo `hybrid_in_at_least_float32`)."""
    for module in modules:
        vars(module).pop("forward", None)
