"""GRPO and DPO: the plain loss equals a direct computation from the formulas, and every method's
gradients equal plain's in float64, with padding, groups and LoRA."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import streambp_core
from streambp_core.models.load import build_model, tiny_config
from tests.unit.test_exactness import GRAD_RTOL, batch, relative_errors

METHODS = ("checkpoint", "mst", "streambp")


def grpo_inputs(ids, mask, prompt_len=5, seed=3, with_old=True, with_ref=True):
    """A group of completions after a shared-length prompt; padding right."""
    gen = torch.Generator().manual_seed(seed)
    completion = mask.clone()
    completion[:, :prompt_len] = 0
    inputs = {
        "advantages": torch.randn(ids.shape[0], generator=gen, dtype=torch.float64),
        "completion_mask": completion,
        "beta": 0.04,
        "epsilon": 0.2,
    }
    if with_old:
        inputs["old_logps"] = -torch.rand(ids.shape, generator=gen, dtype=torch.float64) * 6
    if with_ref:
        inputs["ref_logps"] = -torch.rand(ids.shape, generator=gen, dtype=torch.float64) * 6
    return inputs


def direct_logps(model, ids, mask):
    """log p(token j | tokens < j) for j >= 1, computed straight from full logits: (B, T-1)."""
    logits = model(input_ids=ids, attention_mask=mask).logits.float()
    return torch.log_softmax(logits[:, :-1], dim=-1).gather(-1, ids[:, 1:, None]).squeeze(-1)


def direct_grpo(model, ids, mask, inputs, loss_type):
    logp = direct_logps(model, ids, mask)
    m = inputs["completion_mask"][:, 1:].float()
    ratio = torch.exp(logp - inputs["old_logps"][:, 1:])
    adv = inputs["advantages"][:, None]
    per_token = -torch.min(ratio * adv, torch.clamp(ratio, 0.8, 1.2) * adv)
    ref = inputs["ref_logps"][:, 1:]
    per_token = per_token + inputs["beta"] * (torch.exp(ref - logp) - (ref - logp) - 1)
    if loss_type == "grpo":
        return ((per_token * m).sum(-1) / m.sum(-1).clamp(min=1)).mean()
    if loss_type == "bnpo":
        return (per_token * m).sum() / m.sum().clamp(min=1)
    return (per_token * m).sum() / (ids.shape[0] * inputs["max_completion_length"])


def direct_dpo(model, ids, mask, labels, inputs):
    logp = direct_logps(model, ids, mask)
    seq = (logp * (labels[:, 1:] != -100)).sum(-1)
    pairs = ids.shape[0] // 2
    margin = (seq[:pairs] - inputs["ref_chosen_logps"]) - (seq[pairs:] - inputs["ref_rejected_logps"])
    return -F.logsigmoid(inputs["beta"] * margin).mean()


def run_step(model, method, objective, ids, mask, labels=None, baseline_loss="full", **inputs):
    """One prepared step (partitions 4 and 3); (loss, {name: grad})."""
    model.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, objective=objective, partition_size=4, head_partition_size=3,
                               baseline_loss=baseline_loss) as run:
        loss = run.loss(ids, attention_mask=mask, labels=labels, **inputs)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_all_methods_match(model, objective, ids, mask, labels=None, **inputs):
    ref_loss, ref = run_step(model, "plain", objective, ids, mask, labels, **inputs)
    assert ref, "plain produced no gradients"
    for method in METHODS:
        loss, grads = run_step(model, method, objective, ids, mask, labels, **inputs)
        assert torch.allclose(loss.double(), ref_loss.double(), rtol=1e-6, atol=1e-9), method
        assert grads.keys() == ref.keys(), method
        worst = max(relative_errors(grads, ref).values())
        assert worst <= GRAD_RTOL, f"{method}: {worst:.2e}"


@pytest.mark.parametrize("loss_type", ["grpo", "bnpo", "dr_grpo"])
def test_plain_grpo_equals_the_formula(loss_type):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 18, "right")
    inputs = grpo_inputs(ids, mask) | {"loss_type": loss_type, "max_completion_length": 16}
    with streambp_core.prepare(model, "plain", objective="grpo") as run:
        loss = run.loss(ids, attention_mask=mask, **inputs)
    with torch.no_grad():
        expected = direct_grpo(model, ids, mask, inputs, loss_type)
    assert torch.allclose(loss.double(), expected.double(), rtol=1e-6), (loss, expected)


def test_plain_dpo_equals_the_formula():
    model = build_model(tiny_config("llama"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 15, "right")
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :4] = -100  # the shared prompt
    inputs = {
        "ref_chosen_logps": torch.tensor([-30.0, -28.0], dtype=torch.float64),
        "ref_rejected_logps": torch.tensor([-29.0, -31.5], dtype=torch.float64),
        "beta": 0.1,
    }
    with streambp_core.prepare(model, "plain", objective="dpo") as run:
        loss = run.loss(ids, attention_mask=mask, labels=labels, **inputs)
    with torch.no_grad():
        expected = direct_dpo(model, ids, mask, labels, inputs)
    assert torch.allclose(loss.double(), expected.double(), rtol=1e-6), (loss, expected)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_grpo_exact(family, padding):
    model = build_model(tiny_config(family), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 17, padding)  # a group of 4 completions
    assert_all_methods_match(model, "grpo", ids, mask, **grpo_inputs(ids, mask))


def test_grpo_on_policy_without_reference():
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 3, 14, "right")
    inputs = grpo_inputs(ids, mask, with_old=False, with_ref=False) | {"loss_type": "bnpo"}
    assert_all_methods_match(model, "grpo", ids, mask, **inputs)


@pytest.mark.parametrize("family", ["llama", "qwen2", "qwen3", "mistral"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_dpo_exact(family, padding):
    model = build_model(tiny_config(family), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 4, 16, padding)
    labels = ids.masked_fill(mask == 0, -100)
    labels[:, :3] = -100
    inputs = {
        "ref_chosen_logps": torch.tensor([-40.0, -35.0]),
        "ref_rejected_logps": torch.tensor([-38.0, -37.0]),
        "beta": 0.5,
    }
    assert_all_methods_match(model, "dpo", ids, mask, labels, **inputs)


@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
def test_lora_exact_and_only_adapters_get_grads(objective):
    pytest.importorskip("peft")
    from streambp_core.models.lora import apply_lora

    model = apply_lora(build_model(tiny_config("qwen3"), dtype=torch.float64), rank=4, alpha=16)
    ids, mask = batch(model.config.vocab_size, 2, 15, "right")
    inputs = {}
    if objective == "grpo":
        inputs = grpo_inputs(ids, mask)
    if objective == "dpo":
        inputs = {"ref_chosen_logps": torch.tensor([-40.0]), "ref_rejected_logps": torch.tensor([-38.0])}
    _, ref = run_step(model, "plain", objective, ids, mask, **inputs)
    assert ref and all("lora_" in name for name in ref)
    assert_all_methods_match(model, objective, ids, mask, **inputs)


@pytest.mark.parametrize(
    ("objective", "inputs", "message"),
    [
        ("grpo", {}, "advantages"),
        ("grpo", {"advantages": torch.zeros(3)}, "shape"),
        ("grpo", {"advantages": torch.zeros(2), "loss_type": "sum"}, "loss_type"),
        ("dpo", {"ref_chosen_logps": torch.zeros(1)}, "ref_rejected_logps"),
        ("dpo", {"ref_chosen_logps": torch.zeros(2), "ref_rejected_logps": torch.zeros(2)}, "shape"),
        ("sft", {"advantages": torch.zeros(2)}, "does not take"),
    ],
)
def test_bad_objective_inputs(objective, inputs, message):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 2, 10, "none")
    with streambp_core.prepare(model, "streambp", objective=objective) as run:
        with pytest.raises(streambp_core.ConfigError, match=message):
            run.loss(ids, attention_mask=mask, **inputs)


def test_dpo_needs_pairs():
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    ids, mask = batch(model.config.vocab_size, 3, 10, "none")
    with streambp_core.prepare(model, "plain", objective="dpo") as run:
        with pytest.raises(streambp_core.ConfigError, match="as many rejected"):
            run.loss(
                ids, attention_mask=mask, ref_chosen_logps=torch.zeros(1), ref_rejected_logps=torch.zeros(1)
            )


def test_a_streamed_dpo_heads_sequence_sums_do_not_drift_in_float32():
    """DPO weighs every token's gradient by a sigmoid of the difference of two sequences' summed
    log-probs, each about T * ln(vocab): a float32 running sum over a long sequence's chunks rounds
    at |S| * 2^-24 per chunk, which moves that weight. The streamed head sums a float32 model's chunks
    in float64 (`engine.head.stats_dtype`), so its sums are float32's chunk sums added exactly; an
    objective linear in the sums (sft) keeps float32, its gradient does not depend on them."""
    from streambp_core.engine.stream.head import HeadPlan, _chunk_terms, sequence_stats, stats_dtype
    from streambp_core.engine.stream.objectives import SFTObjective, dpo_objective

    gen = torch.Generator().manual_seed(0)
    pairs, tokens, width, vocab, chunk = 1, 4096, 8, 64, 16
    head = torch.nn.Linear(width, vocab, bias=False)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, width, generator=gen) / width**0.5)
    hidden = torch.randn(2 * pairs, tokens, width, generator=gen)
    labels = torch.randint(0, vocab, (2 * pairs, tokens), generator=gen)
    dpo = dpo_objective(labels, torch.zeros(pairs), torch.zeros(pairs), beta=0.1)
    assert stats_dtype(dpo, torch.float32) == torch.float64 == stats_dtype(dpo, torch.bfloat16)
    assert stats_dtype(SFTObjective.from_labels(labels), torch.float32) == torch.float32
    plan = HeadPlan(norm=None, lm_head=head, partition_size=chunk)
    with torch.no_grad():
        chunked = sequence_stats(plan, dpo, hidden)
        exact = sequence_stats(HeadPlan(norm=None, lm_head=head.double(), partition_size=tokens), dpo,
                               hidden.double())
        head.float()
        running = torch.zeros(2 * pairs)  # the float32 running sum the head kept before
        added = torch.zeros(2 * pairs, dtype=torch.float64)  # the same float32 chunk sums, added exactly
        for start in range(0, tokens, chunk):
            stop = start + chunk
            terms = _chunk_terms(plan, dpo, hidden[:, start:stop], start, stop).sum(dim=1)
            running += terms
            added += terms.double()
    assert chunked.dtype == torch.float64

    def margin_err(stats):
        return abs(float(stats[0] - stats[1]) - float(exact[0] - exact[1]))

    def sums_err(stats):
        return float((stats.double() - added).abs().max())

    assert margin_err(chunked) <= 1e-6 * float(exact.abs().max()), (margin_err(chunked), exact)
    assert sums_err(chunked) <= 1e-12 * float(added.abs().max()), sums_err(chunked)
    assert sums_err(running) > 1e3 * max(sums_err(chunked), 1e-12), (sums_err(running), sums_err(chunked))
