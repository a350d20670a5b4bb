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

Llama 4's router takes the sigmoid of its scores in `.float()`: on a float64 model each token's expert
weight is rounded to float32, and torch's float32 sigmoid rounds an element differently in the vectorised
body than in a loop's tail, so its bits depend on how many tokens a call holds, and a chunked recompute
moves weights by one float32 step. `routers_in_at_least_float32` gives it the sigmoid in the wider of
float32 and the scores' precision too.
"""

from __future__ import annotations

import types

import torch
from torch import Tensor, nn
from torch.nn import functional as F

FLOAT32_NORMS = ("Gemma3RMSNorm",)
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


FLOAT32_SIGMOID_ROUTERS = ("Llama4Router",)
"""Class names of routers whose sigmoid is float32 whatever the model's precision (their weight is not)."""


def _sigmoid_router_in_at_least_float32(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' `Llama4Router.forward` with its sigmoid in the wider of float32 and the scores'
    precision: logits; the top-k logits kept, the others -inf; their sigmoid are the scores."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)
    scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_index, top_value)
    work = torch.promote_types(scores.dtype, torch.float32)
    return torch.sigmoid(scores.to(work)).to(scores.dtype), router_logits


def routers_in_at_least_float32(model: nn.Module, dtype: torch.dtype) -> int:
    """In a model of precision float64 (`dtype`), give every float32-only router a float64 weight and the
    at-least-float32 forward (instance-level, the class is untouched); a model of another precision is left
    as transformers builds it. Returns how many routers changed."""
    if dtype != torch.float64:
        return 0
    changed = 0
    for module in model.modules():
        name = type(module).__name__
        if name in FLOAT32_ROUTERS and "forward" not in vars(module):
            module.weight.data = module.weight.data.to(dtype)
            module.forward = types.MethodType(_router_in_at_least_float32, module)
            changed += 1
        elif name in FLOAT32_SIGMOID_ROUTERS and "forward" not in vars(module):
            module.forward = types.MethodType(_sigmoid_router_in_at_least_float32, module)
            changed += 1
    return changed
