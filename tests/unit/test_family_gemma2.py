"""Gemma 2: attention logit soft-capping (cap * tanh(scores / cap) before the softmax) in every attention
kernel that runs it, final logit soft-capping in the chunked LM head under every objective, the query
scale, sandwich norms and alternating sliding/full layers, exact against plain in float64."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.adapters import decoder_parts, layer_parts
from streambp_core.models.load import build_model, tiny_config
from streambp_core.models.precision import (
    WIDE_EAGER,
    eager_in_at_least_float32,
    norms_in_at_least_float32,
)
from tests.unit.test_exactness import assert_matches_plain, batch
from tests.unit.test_objectives import assert_all_methods_match, grpo_inputs

ATTN_CAP, FINAL_CAP = 0.05, 0.2
"""The tiny preset's caps: near its scores' and logits' sizes, so that tanh bends them."""


def model_of(dtype=torch.float64, **overrides):
    return build_model(tiny_config("gemma2", **overrides), dtype=dtype, seed=0)


def test_tiny_gemma2_reaches_the_engine() -> None:
    model = model_of()
    parts = [layer_parts(layer) for layer in model.model.layers]
    assert [p.attn_softcap for p in parts] == [ATTN_CAP, ATTN_CAP]
    assert [p.sliding_window for p in parts] == [8, None]  # sliding, then full
    assert parts[0].scaling == pytest.approx(24 ** -0.5) and parts[0].q_norm is None
    assert parts[0].attn_out_norm is model.model.layers[0].post_attention_layernorm
    assert parts[0].mlp_out_norm is model.model.layers[0].post_feedforward_layernorm
    assert parts[0].post_norm is model.model.layers[0].pre_feedforward_layernorm
    assert decoder_parts(model).final_softcap == FINAL_CAP
    assert model.config._attn_implementation == WIDE_EAGER  # eager with a float64 softmax in float64
    assert build_model("tiny/gemma2", dtype=torch.float32).config._attn_implementation == WIDE_EAGER


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_each_cap_moves_the_loss(cap) -> None:
    """The caps bite on the tiny model: dropping one moves the gradients far beyond the tests' 1e-12, so a
    kernel or head that dropped it could not match plain."""
    from tests.unit.test_exactness import relative_errors, step

    ids, mask = batch(512, 2, 24, "none")
    _, capped = step(model_of(), "plain", ids, mask)
    _, uncapped = step(model_of(**{cap: None}), "plain", ids, mask)
    assert max(relative_errors(uncapped, capped).values()) > 1e-2


@pytest.mark.parametrize("padding", ["left", "right"])
def test_every_method_matches_plain(padding) -> None:
    model = model_of()
    ids, mask = batch(model.config.vocab_size, 2, 32, padding)  # 4 chunks; the window of 8 crossed
    assert_matches_plain(model, ids, mask, partition_size=8, head_partition_size=8)
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=8, head_partition_size=8,
                         head_mode="fused")


@pytest.mark.parametrize("padding", ["left", "right"])
def test_the_users_model_matches_plain(padding) -> None:
    """A model from transformers' AutoModelForCausalLM (eager attention), its float32 islands (the norms'
    and the eager softmax's `x.float()`) widened for float64 as `build_model` does (`models.precision`)."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(tiny_config("gemma2"), dtype=torch.float64)
    assert type(model).__name__ == "Gemma2ForCausalLM" and model.config._attn_implementation == "eager"
    assert norms_in_at_least_float32(model) == 2 * 4 + 1 and eager_in_at_least_float32(model)
    ids, mask = batch(model.config.vocab_size, 2, 32, padding)
    assert_matches_plain(model.train(), ids, mask, partition_size=8, head_partition_size=8)


def test_left_padding_under_the_users_eager_attention_is_refused_by_name() -> None:
    """transformers' eager gives a padding position before a row's first token the mean of every value,
    which the loss reads where it predicts the first token; the engine gives it zeros, as SDPA does. (A
    float64 model attends through the widened eager while a run is open: tests/unit/
    test_user_model_exactness.py.)"""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_config(tiny_config("gemma2"), dtype=torch.float32)
    ids, mask = batch(model.config.vocab_size, 2, 16, "left")
    with streambp_core.prepare(model, "streambp", partition_size=8, head_partition_size=8) as run:
        with pytest.raises(ConfigError, match="left padding .* eager attention") as refused:
            run.loss(ids, attention_mask=mask)
        assert "\n" not in str(refused.value)
        run.loss(*batch(model.config.vocab_size, 2, 16, "right")).backward()  # right padding runs
    assert eager_in_at_least_float32(model)
    with streambp_core.prepare(model, "streambp", partition_size=8, head_partition_size=8) as run:
        run.loss(ids, attention_mask=mask).backward()


@pytest.mark.slow
@pytest.mark.parametrize("padding", ["left", "right"])
def test_grpo_and_dpo_match_plain(padding) -> None:
    model = model_of()
    ids, mask = batch(model.config.vocab_size, 4, 17, padding)
    assert_all_methods_match(model, "grpo", ids, mask, **grpo_inputs(ids, mask))
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    inputs = {"ref_chosen_logps": torch.tensor([-40.0, -35.0]),
              "ref_rejected_logps": torch.tensor([-38.0, -37.0]), "beta": 0.5}
    assert_all_methods_match(model, "dpo", ids, mask, labels, **inputs)


@pytest.mark.parametrize("window", [None, 5])
def test_the_kernels_soft_cap_is_eager_attentions(window) -> None:
    """`prefix_attention` with a soft-cap, output and gradients, against transformers' eager order of
    operations in float64 (scale, cap, mask, softmax), for a chunk of queries at the end of its keys."""
    from streambp_core.engine.attention.prefix import allowed_mask, prefix_attention

    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 6, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    k, v = (torch.randn(2, 2, 11, 8, dtype=torch.float64, generator=gen, requires_grad=True) for _ in "kv")
    valid = torch.ones(2, 11, dtype=torch.bool)
    valid[1, :3] = False  # left padding
    scale, cap = 0.7, 0.9
    ours = prefix_attention(q, k, v, valid, scale, window=window, softcap=cap)
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * scale
    scores = torch.tanh(scores / cap) * cap
    scores = scores.masked_fill(~allowed_mask(6, valid, 11, window)[:, None], float("-inf"))
    want = torch.softmax(scores, dim=-1).nan_to_num(0.0) @ v.repeat_interleave(2, dim=1)
    grad = torch.randn(ours.shape, dtype=torch.float64, generator=gen)
    ours_grads = torch.autograd.grad(ours, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    torch.testing.assert_close(ours, want, rtol=1e-13, atol=1e-14)
    for a, b in zip(ours_grads, want_grads, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-13)
    uncapped = prefix_attention(q, k, v, valid, scale, window=window)
    assert (uncapped - ours).abs().max() > 1e-3


def test_soft_capped_chunks_never_take_an_uncapped_kernel() -> None:
    """SDPA and the blocked backward (torch's flash kernel) have no cap: a capped chunk plans the exact
    custom ops ('softcap-math', sized for the simulator) and SDPA refuses a cap it would drop."""
    from streambp_core.engine.attention import blocked
    from streambp_core.engine.attention.cuda import cuda_attention, flash_caps, plan_kernel
    from streambp_core.engine.attention.workspace import backward_workspace_bytes

    q = torch.empty(1, 8, 64, 128, dtype=torch.bfloat16, device="meta")
    k = torch.empty(1, 4, blocked.BLOCKED_MIN_KEYS + 64, 128, dtype=torch.bfloat16, device="meta")
    assert plan_kernel("sdpa", q, k, None, None, simulated=True) == "blocked"
    assert plan_kernel("sdpa", q, k, None, None, simulated=True, softcap=50.0) == "softcap-math"
    assert plan_kernel("auto", q, k[:, :, :64], None, 16, simulated=True, softcap=50.0) == "softcap-math"
    assert backward_workspace_bytes("softcap-math", q, k, None) == 4 * 8 * 64 * k.shape[2] * 4
    assert not flash_caps("sdpa", q, None, None)
    small = torch.zeros(1, 2, 4, 8)
    with pytest.raises(ValueError, match="no attention logit soft-cap"):
        cuda_attention(small, small, small, None, 0.3, "sdpa", softcap=1.0)


def test_a_simulated_step_runs() -> None:
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    for method in ("streambp", "plain"):
        result = simulate(StepSpec.of(model="tiny/gemma2", method=method, seq_len_tokens=128,
                                      partition_size=32, head_partition_size=16, dtype="bfloat16"))
        assert result.peak_bytes > 0


@pytest.mark.parametrize("cap", ["attn_logit_softcapping", "final_logit_softcapping"])
def test_a_cap_in_another_family_stays_refused(cap) -> None:
    """Gemma 3's attention never passes its cap to the kernel: a cap there is refused, not guessed."""
    with pytest.raises(ConfigError, match="soft-capping is not supported"):
        build_model(tiny_config("gemma3", **{cap: 5.0}), device="meta")
