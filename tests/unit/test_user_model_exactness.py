"""A user's own model, built with `AutoModelForCausalLM.from_config` (not `build_model`), in each attention
implementation transformers offers for its family, left and right padding, float32 and float64: every
method's loss and gradients equal plain's (transformers' own forward through the model's own attention),
or the method refuses the step by name.

What sets the user's model apart from `build_model`'s: transformers' eager attention gives a padding
position before a row's first token the mean of every value of the row (float32), or NaN (float64, its
softmax in float32); and a float64 model keeps float32 islands (norms, routers, the eager softmax) that a
prepared run widens for its duration (`models.precision`).
"""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.families import TINY_FAMILIES
from streambp_core.models.load import attention_for, experts_options, tiny_config
from streambp_core.models.precision import WIDE_EAGER
from tests.unit.test_exactness import batch, relative_errors

METHODS = ("checkpoint", "mst", "streambp")
BOUND = {torch.float64: 1e-12, torch.float32: 2e-5}
"""Relative bound on a parameter's gradient (and the loss) by the parameter's precision: a router weight
transformers keeps in float32 inside a float64 model has a float32 gradient, a float32 sum."""
SCORES_DTYPE_SOFTMAX = ("llama4", "gpt-oss")
"""Families whose eager softmax is in the scores' precision: a float64 model of theirs is not widened."""


def user_model(family: str, attn: str, dtype: torch.dtype):
    """The model a user builds from the family's tiny config, weights seeded, dropout off."""
    from transformers import AutoModelForCausalLM

    config = tiny_config(family)
    if attention_for(config, attn) != attn:
        pytest.skip(f"transformers offers no {attn} attention for {family}")
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, attn_implementation=attn, dtype=dtype,
                                             **experts_options(config, dtype))
    assert model.config._attn_implementation == attn
    return model.train()


def step(model, method: str, ids, mask, **options):
    model.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, **options) as run:
        loss = run.loss(ids, attention_mask=mask)
        loss.backward()
    return loss.detach(), {n: p.grad.detach().clone() for n, p in model.named_parameters()}


def refused(family: str, attn: str, dtype: torch.dtype, padding: str, method: str) -> bool:
    """streambp refuses left padding through transformers' eager attention, whose padding positions
    before a row's first token average the row's values where the engine gives zeros: in float32 for
    every family but gpt-oss (its sinks give zeros too), and in float64 for Llama 4 (a float64 model of
    any other family attends through the widened eager, zeros there, while the run is open)."""
    if method != "streambp" or attn != "eager" or padding != "left" or family == "gpt-oss":
        return False
    return dtype == torch.float32 or family in SCORES_DTYPE_SOFTMAX


def check_user_model(family: str, attn: str, dtype: torch.dtype, padding: str) -> None:
    model = user_model(family, attn, dtype)
    ids, mask = batch(model.config.vocab_size, 2, 23, padding)
    ref_loss, ref = step(model, "plain", ids, mask)
    assert torch.isfinite(ref_loss)
    for method in METHODS:
        options = {"partition_size": 5, "head_partition_size": 4}
        if refused(family, attn, dtype, padding, method):
            with pytest.raises(ConfigError, match="left padding .* eager attention") as refusal:
                step(model, method, ids, mask, **options)
            assert "\n" not in str(refusal.value)
            continue
        loss, grads = step(model, method, ids, mask, **options)
        assert abs(loss - ref_loss) <= BOUND[dtype] * abs(ref_loss), f"{method}: loss {loss} vs {ref_loss}"
        dtypes = {name: p.dtype for name, p in model.named_parameters()}
        for name, err in relative_errors(grads, ref).items():
            assert err <= BOUND[dtypes[name]], f"{family} {attn} {padding} {method}: {name} {err:.2e}"
    assert model.config._attn_implementation == attn  # every run gave the model back as it was


QUICK = [("llama", attn, dtype, padding) for attn in ("eager", "sdpa") for dtype in ("float32", "float64")
         for padding in ("left", "right")]
QUICK += [("deepseek-v3", "eager", "float64", "left"), ("gemma2", "eager", "float32", "left"),
          ("gemma2", "eager", "float64", "left"), ("gpt-oss", "eager", "float32", "left")]
"""Llama in every setting; DeepSeek-V3's float32 router and latent attention, Gemma 2's soft-capped
eager attention and float32 norms, gpt-oss's sinks."""


@pytest.mark.parametrize(("family", "attn", "dtype", "padding"), QUICK)
def test_the_users_model_matches_plain_or_is_refused(family, attn, dtype, padding) -> None:
    check_user_model(family, attn, getattr(torch, dtype), padding)


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["left", "right"])
@pytest.mark.parametrize("dtype", ["float32", "float64"])
@pytest.mark.parametrize("attn", ["eager", "sdpa"])
@pytest.mark.parametrize("family", TINY_FAMILIES)
def test_every_family_matches_plain_or_is_refused(family, attn, dtype, padding) -> None:
    check_user_model(family, attn, getattr(torch, dtype), padding)


def test_a_float64_eager_model_is_nan_at_left_padding_outside_a_run_and_exact_inside() -> None:
    """transformers' eager softmax is float32: a float64 mask's minimum becomes -inf there, and a query that
    sees no key is NaN, which reaches every position through the next layer's values. While a run is open
    the model attends through `WIDE_EAGER` (softmax in float64, zeros for such a query), every method
    alike, and the model's own eager comes back when the run closes."""
    model = user_model("llama", "eager", torch.float64)
    ids, mask = batch(model.config.vocab_size, 2, 23, "left")
    assert torch.isnan(model(input_ids=ids, attention_mask=mask, labels=ids).loss)
    with streambp_core.prepare(model, "plain") as run:
        assert model.config._attn_implementation == WIDE_EAGER
        assert torch.isfinite(run.loss(ids, attention_mask=mask))
    assert model.config._attn_implementation == "eager"
    assert torch.isnan(model(input_ids=ids, attention_mask=mask, labels=ids).loss)


def test_a_float64_models_float32_router_and_norms_are_widened_only_while_a_run_is_open() -> None:
    """GLM-4.5's router keeps a float32 weight and float32 logits; Gemma 2's norms compute in float32. A
    run gives them at-least-float32 forwards (the router's weight stays float32) and takes them back."""
    routed = user_model("glm4-moe", "sdpa", torch.float64)
    normed = user_model("gemma2", "eager", torch.float64)
    for model, kind in ((routed, "Glm4MoeTopkRouter"), (normed, "Gemma2RMSNorm")):
        islands = [m for m in model.modules() if type(m).__name__ == kind]
        assert islands and not any("forward" in vars(m) for m in islands)
        with streambp_core.prepare(model, "streambp", partition_size=5, head_partition_size=4):
            assert all("forward" in vars(m) for m in islands)
        assert not any("forward" in vars(m) for m in islands)
    router = next(m for m in routed.modules() if type(m).__name__ == "Glm4MoeTopkRouter")
    assert router.weight.dtype == torch.float32
