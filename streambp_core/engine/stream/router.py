"""The router load-balancing loss of a mixture-of-experts model, from per-layer sums, so that a streamed run
gets transformers' value and gradients (`load_balancing_loss_func`, Switch Transformer eq. 4-6).

transformers, over the L routed layers and the N real tokens (padding excluded by the attention mask):
f_e = (top-k picks of expert e) / (L N), P_e = (routing probabilities of e, summed) / (L N),
aux = E * sum_e f_e P_e, and the training loss adds `router_aux_loss_coef * aux`. The picks carry no
gradient and P is a sum over tokens, so each layer contributes its own sums: a streamed layer returns its
probability sum p_l (E,) and its picks from the no-grad forward, and in backward adds grad(p_l) . (the
chunk's probability sum) to every recomputed chunk. As in transformers, the softmax is in the router
logits' precision and each token's probabilities are rounded to float32.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from streambp_core.dtypes import at_least_float32


@dataclass(frozen=True)
class RouterAux:
    """The load-balancing loss's settings, read from a model config."""

    num_experts: int
    top_k: int
    coef: float


NO_ROUTER_LOSS = ("llama4_text",)
"""`model_type`s whose causal LM adds no load-balancing loss though their config has its settings."""


def router_aux(config) -> RouterAux | None:
    """The settings when the config enables the loss (`output_router_logits`) and its causal LM adds it
    (a config with `router_aux_loss_coef`; GLM-4.5's sigmoid routers have no such loss, and Llama 4's
    causal LM never adds it), else None."""
    if not getattr(config, "output_router_logits", False) or not hasattr(config, "router_aux_loss_coef"):
        return None
    if getattr(config, "model_type", None) in NO_ROUTER_LOSS:
        return None
    experts = getattr(config, "num_experts", None) or config.num_local_experts
    return RouterAux(num_experts=experts, top_k=config.num_experts_per_tok, coef=config.router_aux_loss_coef)


def routing_sums(logits: Tensor, valid: Tensor | None, aux: RouterAux) -> tuple[Tensor, Tensor]:
    """Probability sums (E,) (differentiable) and top-k pick counts (E,) float32 of router logits (n, E)
    over the rows marked by `valid` (n,) (None: every row), as transformers sums them: each token's
    probabilities rounded to float32. The sums are float32, or float64 for float64 logits (so that the
    loss's value does not depend on how a sequence was cut into chunks)."""
    probs = torch.softmax(logits, dim=-1)
    _, selected = torch.topk(probs, aux.top_k, dim=-1)
    weight = torch.ones(logits.shape[0], device=logits.device) if valid is None else valid.float()
    picks = logits.new_zeros(aux.num_experts, dtype=torch.float32)
    picks.scatter_add_(0, selected.reshape(-1), weight.repeat_interleave(aux.top_k))
    work = at_least_float32(logits.dtype)
    return (probs.float() * weight[:, None]).to(work).sum(dim=0), picks


def aux_loss(prob_sums: list[Tensor], picks: list[Tensor], valid_tokens: Tensor | int, aux: RouterAux):
    """`router_aux_loss_coef * aux` from every routed layer's sums (see the module docstring).

    Its gradient follows transformers' float32 arithmetic step by step; for float64 sums the value is the
    float64 one (the float32 value plus a constant correction, which carries no gradient).
    """
    rows = len(prob_sums) * valid_tokens
    tokens_per_expert = torch.stack(picks).sum(dim=0) / rows
    prob_sum = torch.stack(prob_sums).sum(dim=0)
    loss = aux.coef * ((tokens_per_expert * (prob_sum.float() / rows)).sum() * aux.num_experts)
    if prob_sum.dtype == torch.float32:
        return loss
    precise = aux.coef * ((tokens_per_expert.to(prob_sum.dtype) * (prob_sum / rows)).sum() * aux.num_experts)
    return loss.to(precise.dtype) + (precise - loss.to(precise.dtype)).detach()


class RouterTap:
    """Context manager: the router logits (n, E) that a router module (the MoE block's `gate`) outputs
    inside the block, kept in `.logits` (a forward hook on that instance, removed on exit)."""

    def __init__(self, router: nn.Module) -> None:
        self.router = router
        self.logits: Tensor | None = None
        self._handle = None

    def _keep(self, module, inputs, output) -> None:
        self.logits = output[0]

    def __enter__(self) -> RouterTap:
        self._handle = self.router.register_forward_hook(self._keep)
        return self

    def __exit__(self, *exc_info) -> None:
        self._handle.remove()


class ChunkRouting:
    """One routed layer's load-balancing sums in one streamed pass.

    Forward (`grad` None): `chunk(rows)` around each chunk's computation adds the chunk's sums to
    `prob_sum` and `picks`. Backward (`grad` = dL/d prob_sum): `chunk(rows)` around each recomputed chunk
    sets `term`, grad . (the chunk's probability sum), to back-propagate with the chunk's output.
    """

    def __init__(self, router: nn.Module, aux: RouterAux, grad: Tensor | None = None) -> None:
        self.router, self.aux, self.grad = router, aux, grad
        self.prob_sum: Tensor | None = None
        self.picks: Tensor | None = None
        self.term: Tensor | None = None

    @contextmanager
    def chunk(self, valid_rows: Tensor | None):
        """Tap the router while the block runs; `valid_rows` (B, c) marks the chunk's real tokens."""
        with RouterTap(self.router) as tap:
            yield
        rows = None if valid_rows is None else valid_rows.reshape(-1)
        prob_sum, picks = routing_sums(tap.logits, rows, self.aux)
        if self.grad is not None:
            self.term = (prob_sum * self.grad).sum()
            return
        self.prob_sum = prob_sum if self.prob_sum is None else self.prob_sum + prob_sum
        self.picks = picks if self.picks is None else self.picks + picks
