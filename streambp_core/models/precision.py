"""Norms that keep a float64 model in float64.

Gemma 3's RMSNorm (and gpt-oss's) computes in `x.float()`, meant as an upcast for bfloat16; on a float64
model it rounds every norm to float32, and its weight gradient becomes a float32 sum over all tokens, so
the model's own backward is float32-accurate and no float64 comparison of methods can reach 1e-10 on those
weights. `norms_in_at_least_float32` makes each such norm compute in the wider of float32 and its input
precision: for float32, float16 and bfloat16 inputs nothing changes; float64 stays float64.

GLM-4.5's router keeps its weight in float32 (`_keep_in_fp32_modules_strict`) and computes its logits from
`.type(torch.float32)` of input and weight: the same float32 island, whose weight gradient is a float32
sum. `routers_in_at_least_float32` gives such a router of a float64 model a float64 weight (float32 values
widen exactly) and float64 logits; the routing that follows is transformers' step for step. A model of
another precision keeps transformers' router untouched.

Gemma 2 attends through transformers' eager attention (SDPA has no soft-cap), whose softmax is
`dtype=torch.float32` whatever the scores' precision. `eager_in_at_least_float32` gives a Gemma 2 that
attends eagerly the same attention, step for step, with the softmax in the wider of float32 and the
scores' precision (`WIDE_EAGER`, a named implementation set on that model only: float64 stays float64,
other precisions compute as eager does). One more difference: a query that sees no real key (a padding
position before a row's first real token, left padding) outputs zeros, as transformers' SDPA and
flash-attention paths and the engine give it, where eager averages every value of the row, later real
tokens included; that position's output reaches the loss through its prediction of the row's first real
token (streambp refuses left padding on a model that still attends eagerly: `guards.check_eager_padding`).
Every other family's eager but Llama 4's and gpt-oss's takes its softmax in float32 as well, where a float64
mask's minimum becomes -inf and a query that sees no key is NaN; `eager_in_at_least_float32(model, None)`
gives any of them `WIDE_EAGER`.

Llama 4's router takes the sigmoid of its scores in `.float()`: on a float64 model each token's expert
weight is rounded to float32, and torch's float32 sigmoid rounds an element differently in the vectorised
body than in a loop's tail, so its bits depend on how many tokens a call holds, and a chunked recompute
moves weights by one float32 step. `routers_in_at_least_float32` gives it the sigmoid in the wider of
float32 and the scores' precision too.

Qwen3.5 has three such islands: its RMSNorm (Gemma 3's form), the gated RMSNorm of its linear attention,
and the linear attention's decay and delta rule (`A_log.float()`, `a.float()`, and transformers'
`torch_chunk_gated_delta_rule` casting q, k, v, g and beta to float32). A float32 recurrence whose
weight gradients are float32 sums cannot be compared chunk by chunk to 1e-10 either, so
`hybrid_in_at_least_float32` gives each Gated DeltaNet of a float64 model a forward that runs
transformers' own forward under `WideFloat32Casts`: a cast of a float64 tensor to float32 keeps it
float64 (the math is transformers', step for step, only in float64). `build_model` applies it, and the
engine's chunked linear attention computes under the same casts exactly when the module does
(`delta_casts`).

Gemma 4 has two: its RMSNorm (the weight optional: its V norm and its router's norm have none) and its
router's softmax (`dtype=torch.float32`), both widened as above.

A user's own float64 model (built without `build_model`): every prepared run widens the same islands for
its duration, every method alike (`islands_in_at_least_float32`, and the eager softmax through
`eager_in_at_least_float32(model, None)`), and gives the model back as it was when it closes. There a router
weight transformers keeps in float32 stays float32 (its logits come from its exact float64 widening); its
own gradient is a float32 sum, exact to float32's rounding only.
"""

from __future__ import annotations

import types
from contextlib import AbstractContextManager, nullcontext

import torch
from torch import Tensor, nn
from torch.nn import functional as F

from streambp_core.dtypes import at_least_float32
from streambp_core.models.precision_v4 import v4_in_at_least_float32
from streambp_core.models.wide_casts import WideFloat32Casts, forward_under_wide_casts


def _norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    work = at_least_float32(x.dtype)
    return (self._norm(x.to(work)) * (1.0 + self.weight.to(work))).type_as(x)


def _weight_norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    """gpt-oss's RMSNorm, weight * x / rms(x), in the wider of float32 and x's precision."""
    work = at_least_float32(x.dtype)
    wide = x.to(work)
    wide = wide * torch.rsqrt(wide.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight * wide).to(x.dtype)


def _centred_norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    """Cohere 2's LayerNorm, weight * (x - mean) / std(x) (no bias), in the wider of float32 and x's
    precision."""
    work = at_least_float32(x.dtype)
    wide = x.to(work)
    centred = wide - wide.mean(-1, keepdim=True)
    wide = centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + self.variance_epsilon)
    return (self.weight.to(work) * wide).to(x.dtype)


def _optional_weight_norm_in_at_least_float32(self, x: Tensor) -> Tensor:
    """Gemma 4's RMSNorm, x / rms(x) times its weight where it has one (`with_scale`; its V norm has none), in
    the wider of float32 and x's precision."""
    work = at_least_float32(x.dtype)
    normed = self._norm(x.to(work))
    if self.with_scale:
        normed = normed * self.weight.to(work)
    return normed.type_as(x)


FLOAT32_NORMS = {
    "Gemma4RMSNorm": _optional_weight_norm_in_at_least_float32,
    **dict.fromkeys(("Gemma3RMSNorm", "Gemma2RMSNorm", "Qwen3_5RMSNorm", "Qwen3_5MoeRMSNorm",
                     "Qwen3NextRMSNorm", "Qwen4ExpTextRMSNorm"), _norm_in_at_least_float32),
    **dict.fromkeys(("GptOssRMSNorm", "NemotronHRMSNorm"), _weight_norm_in_at_least_float32),
    "Cohere2LayerNorm": _centred_norm_in_at_least_float32,
}
"""Class names of norms that compute in `x.float()`, and their at-least-float32 forwards."""


def norms_in_at_least_float32(model: nn.Module) -> int:
    """Give every float32-only norm of `model` the at-least-float32 forward (instance-level, the class is
    untouched); returns how many norms changed."""
    changed = 0
    for module in model.modules():
        wide = FLOAT32_NORMS.get(type(module).__name__)
        if wide is not None and "forward" not in vars(module):
            module.forward = types.MethodType(wide, module)
            changed += 1
    return changed


FLOAT32_ROUTERS = ("Glm4MoeTopkRouter", "DeepseekV3TopkRouter", "Glm4MoeLiteTopkRouter",
                   "NemotronHTopkRouter", "GlmMoeDsaTopkRouter", "DeepseekV32TopkRouter")
"""Class names of routers whose weight and logits are float32 whatever the model's precision."""


def _router_in_at_least_float32(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' `Glm4MoeTopkRouter.forward` (DeepSeek-V3's, V3.2's and GLM-5's are the same) with its
    logits in the wider of float32 and the input's precision: sigmoid scores; top-k experts of scores +
    e_score_correction_bias within the `topk_group` best groups (a group's score: its two best); their
    scores, normalised (`norm_topk_prob`) and scaled by `routed_scaling_factor`, are the weights."""
    work = at_least_float32(hidden_states.dtype)
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


FLOAT32_SIGMOID_ROUTERS = ("Llama4Router", "MiniMaxM2TopKRouter", "Gemma4TextRouter")
"""Class names of routers whose sigmoid (Gemma 4's: softmax) is float32 whatever the model's precision (their
weight is not)."""


def _sigmoid_router_in_at_least_float32(self, hidden_states: Tensor) -> tuple[Tensor, Tensor]:
    """transformers' `Llama4Router.forward` with its sigmoid in the wider of float32 and the scores'
    precision: logits; the top-k logits kept, the others -inf; their sigmoid are the scores."""
    router_logits = F.linear(hidden_states, self.weight, self.bias)
    top_value, top_index = torch.topk(router_logits, self.top_k, dim=1)
    scores = torch.full_like(router_logits, float("-inf")).scatter_(1, top_index, top_value)
    work = at_least_float32(scores.dtype)
    return torch.sigmoid(scores.to(work)).to(scores.dtype), router_logits


def _bias_sigmoid_router_in_at_least_float32(self, hidden_states: Tensor, e_score_correction_bias: Tensor):
    """transformers' `MiniMaxM2TopKRouter.forward` with its sigmoid in the wider of float32 and the logits'
    precision: top-k experts of sigmoid(logits) + e_score_correction_bias; their sigmoids, normalised, are
    the weights."""
    hidden_states = hidden_states.reshape(-1, self.hidden_dim)
    router_logits = F.linear(hidden_states.to(self.weight.dtype), self.weight)  # (n, E)
    routing_weights = torch.sigmoid(router_logits.to(at_least_float32(router_logits.dtype)))
    _, top_k_index = torch.topk(routing_weights + e_score_correction_bias, self.top_k, dim=-1, sorted=False)
    top_k_weights = routing_weights.gather(1, top_k_index)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return router_logits, top_k_weights, top_k_index


def _softmax_router_in_at_least_float32(self, hidden_states: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """transformers' `Gemma4TextRouter.forward` with its softmax in the wider of float32 and the scores'
    precision: scores of the unweighted-normed, scaled input; the top-k probabilities, normalised, times
    each expert's scale are the weights."""
    hidden_states = self.norm(hidden_states) * self.scale * self.scalar_root_size
    expert_scores = self.proj(hidden_states)  # (n, E)
    probabilities = F.softmax(expert_scores, dim=-1, dtype=at_least_float32(expert_scores.dtype))
    top_k_weights, top_k_index = torch.topk(probabilities, k=self.config.top_k_experts, dim=-1)
    top_k_weights /= top_k_weights.sum(dim=-1, keepdim=True)
    return probabilities, top_k_weights * self.per_expert_scale[top_k_index], top_k_index


SIGMOID_ROUTER_FORWARDS = {"Llama4Router": _sigmoid_router_in_at_least_float32,
                           "MiniMaxM2TopKRouter": _bias_sigmoid_router_in_at_least_float32,
                           "Gemma4TextRouter": _softmax_router_in_at_least_float32}
"""The at-least-float32 forward of each router of `FLOAT32_SIGMOID_ROUTERS`."""


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
            module.forward = types.MethodType(SIGMOID_ROUTER_FORWARDS[name], module)
            changed += 1
    return changed


WIDE_EAGER = "streambp_eager"
"""The attention implementation of a Gemma 2 the package builds: transformers' eager, its softmax in at
least float32 (float64 in a float64 model), zeros for a query that sees no key (module docstring)."""
WIDE_EAGER_FAMILIES = ("gemma2",)
"""Families whose eager attention (scale, soft-cap, additive mask, float32 softmax) `WIDE_EAGER` repeats."""


def _eager_in_at_least_float32(module: nn.Module, query: Tensor, key: Tensor, value: Tensor,
                               attention_mask: Tensor | None, dropout: float = 0.0,
                               scaling: float | None = None, softcap: float | None = None,
                               **kwargs) -> tuple[Tensor, Tensor]:
    """transformers' Gemma 2 `eager_attention_forward` with the softmax in the wider of float32 and the
    queries' precision: K/V repeated to the query heads, scaled scores, soft-capped
    (cap * tanh(s / cap)), plus the additive mask, softmax (zero for a query that sees no key), dropout,
    times V; returns (B, T, H, hd)."""
    groups = module.num_key_value_groups
    key, value = (t.repeat_interleave(groups, dim=1) if groups > 1 else t for t in (key, value))
    scale = module.head_dim ** -0.5 if scaling is None else scaling
    scores = torch.matmul(query, key.transpose(2, 3)) * scale
    if softcap is not None:
        scores = torch.tanh(scores / softcap) * softcap
    if attention_mask is not None:
        scores = scores + attention_mask
    work = at_least_float32(query.dtype)
    weights = F.softmax(scores, dim=-1, dtype=work).to(query.dtype)
    if attention_mask is not None:  # a query that sees no key: zeros, as SDPA (module docstring)
        weights = weights * (attention_mask == 0).any(dim=-1, keepdim=True)
    weights = F.dropout(weights, p=dropout, training=module.training)
    return torch.matmul(weights, value).transpose(1, 2).contiguous(), weights


EAGER_KEYLESS_ZEROS = ("gpt_oss", "deepseek_v4")
"""Model types whose eager attention gives a query that sees no key zeros, as the engine does: gpt-oss's and
DeepSeek-V4's sinks take its whole softmax (every other eager averages every value of the row)."""
EAGER_SOFTMAX_IN_SCORES_DTYPE = ("llama4", "llama4_text", "gpt_oss", "deepseek_v4")
"""Model types whose eager attention takes its softmax in the scores' precision (gpt-oss's and DeepSeek-V4's
with their sinks, which `WIDE_EAGER` would drop), not in float32: a float64 model of theirs attends in
float64 already."""


def eager_in_at_least_float32(model: nn.Module,
                              families: tuple[str, ...] | None = WIDE_EAGER_FAMILIES) -> bool:
    """Give a model of `families` (None: every model type whose eager softmax is float32, i.e. not in
    `EAGER_SOFTMAX_IN_SCORES_DTYPE`) that attends through transformers' eager attention the `WIDE_EAGER`
    implementation (this model's setting only; registered under its own name, with eager's mask);
    returns whether it changed. `model.set_attn_implementation("eager")` undoes it."""
    config = model.config
    if families is None:
        wanted = config.model_type not in EAGER_SOFTMAX_IN_SCORES_DTYPE
    else:
        wanted = config.model_type in families
    if config._attn_implementation != "eager" or not wanted:
        return False
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, eager_mask

    AttentionInterface.register(WIDE_EAGER, _eager_in_at_least_float32)
    AttentionMaskInterface.register(WIDE_EAGER, eager_mask)
    model.set_attn_implementation(WIDE_EAGER)
    return True
FLOAT32_DELTA_NETS = ("Qwen3_5GatedDeltaNet", "Qwen3_5MoeGatedDeltaNet", "Qwen3NextGatedDeltaNet",
                      "NemotronHMamba2Mixer", "GraniteMoeHybridMambaLayer", "BambaMixer", "FalconH1Mixer",
                      "Qwen4ExpTextGatedDeltaNet")
"""Class names of linear attentions whose decay, delta rule and gated norm compute in float32 (and of Mamba2
mixers, whose SSD scan and gated norm do)."""


def delta_casts(module: nn.Module) -> AbstractContextManager:
    """The casts a linear attention module's forward computes under: `WideFloat32Casts` once
    `hybrid_in_at_least_float32` gave it the at-least-float32 forward, else transformers' own."""
    forward = vars(module).get("forward")
    widened = getattr(forward, "__func__", None) is forward_under_wide_casts
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
        forward = forward_under_wide_casts if name in FLOAT32_DELTA_NETS else FLOAT32_NORMS[name]
        module.forward = types.MethodType(forward, module)
        changed.append(module)
    return changed


def restore_forwards(modules: list[nn.Module]) -> None:
    """Give `modules` their class's forward again (undo `hybrid_in_at_least_float32`)."""
    for module in modules:
        vars(module).pop("forward", None)


def islands_in_at_least_float32(model: nn.Module, dtype: torch.dtype) -> list[nn.Module]:
    """For one prepared run of a model of precision float64 (`dtype`), one a user built without
    `build_model` included: the float32 islands `build_model` widens, widened at instance level for the
    run's duration (`restore_forwards` undoes it): a hybrid's (`hybrid_in_at_least_float32`), every
    float32-only norm (`FLOAT32_NORMS`) and every float32 router's forward (`FLOAT32_ROUTERS`,
    `FLOAT32_SIGMOID_ROUTERS`). A router weight transformers keeps in float32 stays float32: its logits
    come from its exact float64 widening, so they no longer depend on how many tokens one call holds, and
    only its own gradient is still a float32 sum. A model of another precision is left as it is. Returns
    the modules changed."""
    if dtype != torch.float64:
        return []
    changed = hybrid_in_at_least_float32(model, dtype) + v4_in_at_least_float32(model, dtype, widen=False)
    for module in model.modules():
        name = type(module).__name__
        if "forward" in vars(module):
            continue
        forward = FLOAT32_NORMS.get(name)
        if name in FLOAT32_ROUTERS:
            forward = _router_in_at_least_float32
        elif name in FLOAT32_SIGMOID_ROUTERS:
            forward = SIGMOID_ROUTER_FORWARDS[name]
        if forward is not None:
            module.forward = types.MethodType(forward, module)
            changed.append(module)
    return changed


def float32_islands_widened(model: nn.Module) -> nn.Module:
    """`model` with every float32 island above in the wider of float32 and its precision (float64 stays
    float64, other precisions compute as transformers does): the hybrid linear attentions, the norms, the
    routers and Gemma 2's eager attention, as `streambp_core.models.load.build_model` builds a model.
    Instance-level, idempotent; returns `model`."""
    v4_in_at_least_float32(model, model.dtype, widen=True)
    hybrid_in_at_least_float32(model, model.dtype)
    norms_in_at_least_float32(model)
    routers_in_at_least_float32(model, model.dtype)
    eager_in_at_least_float32(model)
    return model
