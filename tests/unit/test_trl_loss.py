"""The trl protocol: plain's and checkpoint's GRPO and DPO losses computed as TRL 0.17's trainers do
(`baseline_loss="trl"`) equal the formulas, every method matches plain under it in float64, and the
simulator sees its allocations (completion-only logits in their own dtype, no float32 copy)."""

from __future__ import annotations

from dataclasses import replace
from functools import partial

import pytest
import torch
import torch.nn.functional as F

import streambp_core
from streambp_core.config import ConfigError, StepSpec
from streambp_core.methods.trl_loss import TRL_GRPO_TEMPERATURE, selective_log_softmax
from streambp_core.models.load import build_model, tiny_config
from streambp_core.step.run.setup import build_setup, step_inputs
from streambp_core.step.run.tracked import tracked_step
from tests.unit.test_exactness import GRAD_RTOL, batch, relative_errors
from tests.unit.test_objectives import grpo_inputs
from tests.unit.test_objectives import run_step as objectives_run_step

PROMPT = 5


run_step = partial(objectives_run_step, baseline_loss="trl")  # one step under trl unless told otherwise


def assert_methods_match_trl_plain(model, objective, ids, mask, labels=None, **inputs):
    """plain under trl equals plain under full, and every other method under trl equals it."""
    ref_loss, ref = run_step(model, "plain", objective, ids, mask, labels, **inputs)
    full_loss, full = run_step(model, "plain", objective, ids, mask, labels, baseline_loss="full", **inputs)
    assert abs(float(full_loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    assert max(relative_errors(full, ref).values()) <= GRAD_RTOL
    for method in ("checkpoint", "mst", "streambp"):
        loss, grads = run_step(model, method, objective, ids, mask, labels, **inputs)
        assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss)), method
        assert grads.keys() == ref.keys(), method
        worst = max(relative_errors(grads, ref).values())
        assert worst <= GRAD_RTOL, f"{method}: {worst:.2e}"


def formula_logps(model, ids, mask, temperature=1.0):
    """log p(token j | tokens < j) for j >= 1 from full logits divided by the temperature: (B, T-1)."""
    logits = model(input_ids=ids, attention_mask=mask).logits[:, :-1] / temperature
    return torch.log_softmax(logits, dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_trl_grpo_equals_the_formula_and_every_method_matches(loss_type):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 17, "right")
    inputs = grpo_inputs(ids, mask, prompt_len=PROMPT) | {
        "loss_type": loss_type, "max_completion_length": 12, "temperature": 0.7,
        "logits_to_keep": ids.shape[1] - PROMPT}
    with streambp_core.prepare(model, "plain", objective="grpo", baseline_loss="trl") as run, torch.no_grad():
        loss = run.loss(ids, attention_mask=mask, **inputs)
        logp = formula_logps(model, ids, mask, temperature=0.7)
    m = inputs["completion_mask"][:, 1:].double()
    ratio = torch.exp(logp - inputs["old_logps"][:, 1:])
    adv = inputs["advantages"][:, None]
    ref = inputs["ref_logps"][:, 1:]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    per_token = per_token + 0.04 * (torch.exp(ref - logp) - (ref - logp) - 1)
    expected = {"grpo": ((per_token * m).sum(-1) / m.sum(-1)).mean(), "bnpo": (per_token * m).sum() / m.sum(),
                "dr_grpo": (per_token * m).sum() / (4 * 12)}[loss_type]
    assert torch.allclose(loss, expected, rtol=1e-12, atol=0)
    assert_methods_match_trl_plain(model, "grpo", ids, mask, **inputs)


@pytest.mark.parametrize("padding", ["right", "left"])
def test_trl_dpo_equals_the_formula_and_every_method_matches(padding):
    model = build_model(tiny_config("llama"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 16, padding)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    inputs = {"ref_chosen_logps": torch.tensor([-40.0, -35.0], dtype=torch.float64),
              "ref_rejected_logps": torch.tensor([-38.0, -37.0], dtype=torch.float64), "beta": 0.5}
    with streambp_core.prepare(model, "plain", objective="dpo", baseline_loss="trl") as run, torch.no_grad():
        loss = run.loss(ids, attention_mask=mask, labels=labels, **inputs)
        seq = (formula_logps(model, ids, mask) * (labels[:, 1:] != -100)).sum(-1)
    margin = (seq[:2] - inputs["ref_chosen_logps"]) - (seq[2:] - inputs["ref_rejected_logps"])
    assert torch.allclose(loss, -F.logsigmoid(0.5 * margin).mean(), rtol=1e-12, atol=0)
    assert_methods_match_trl_plain(model, "dpo", ids, mask, labels, **inputs)


@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_selective_log_softmax_is_the_gathered_log_softmax(dtype):
    logits = torch.randn(3, 5, 11, generator=torch.Generator().manual_seed(0), dtype=torch.float64)
    index = torch.randint(0, 11, (3, 5), generator=torch.Generator().manual_seed(1))
    expected = logits.log_softmax(-1).gather(-1, index[..., None]).squeeze(-1)
    got = selective_log_softmax(logits.to(dtype), index)
    assert got.dtype == dtype  # in the logits' dtype: no float32 copy
    assert torch.allclose(got.double(), expected, rtol=1e-12 if dtype == torch.float64 else 2e-2)


@pytest.mark.parametrize("bad, message", [({"logits_to_keep": 10}, "completion_mask marks tokens"),
                                          ({"logits_to_keep": 17}, "logits_to_keep must be"),
                                          ({"temperature": 0.0}, "temperature must be")])
def test_grpo_inputs_that_trl_would_compute_differently_are_refused(bad, message):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 2, 17, "none")
    inputs = grpo_inputs(ids, mask, prompt_len=PROMPT) | bad
    for baseline_loss in ("full", "trl"):
        with streambp_core.prepare(model, "plain", objective="grpo", baseline_loss=baseline_loss) as run:
            with pytest.raises(ConfigError, match=message):
                run.loss(ids, attention_mask=mask, **inputs)


@pytest.mark.parametrize("objective, rows", [("grpo", 4), ("dpo", 2)])
def test_the_simulator_sees_the_trl_logits(objective, rows):
    """The most logits bytes of any phase of a simulated step (the real step on meta tensors): trl at most
    3 bf16 copies of the kept positions (GRPO: the last three quarters); full at least the bf16 logits,
    their float32 copy and its float32 log-softmax (10 bytes) of every position."""
    seq_len, config = 512, tiny_config("llama")
    spec = StepSpec.of(model="tiny/llama", method="checkpoint", objective=objective, optimizer="adamw",
                       batch_size=rows if objective == "grpo" else rows // 2, seq_len_tokens=seq_len)
    logits = {}
    for protocol in ("default", "trl"):
        record = tracked_step(build_setup(replace(spec, protocol=protocol), config, "meta"), "meta")
        logits[protocol] = max(phase.result.peak_breakdown_bytes["logits"] for phase in record.phases)
    kept = seq_len - seq_len // 4 if objective == "grpo" else seq_len
    assert 0 < logits["trl"] <= 3 * rows * kept * config.vocab_size * 2
    assert logits["default"] >= 10 * rows * seq_len * config.vocab_size


def test_the_trl_protocol_step_samples_at_trls_temperature():
    spec = StepSpec.of(model="tiny/llama", method="plain", objective="grpo", protocol="trl",
                       seq_len_tokens=64)
    assert spec.stream.baseline_loss == "trl"
    assert step_inputs(spec, 512, "cpu")["temperature"] == TRL_GRPO_TEMPERATURE
    assert "temperature" not in step_inputs(replace(spec, protocol="default"), 512, "cpu")
