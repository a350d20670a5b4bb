"""The engine's speed paths stay exact: the fused LM head (gradients from the forward's logits), the layer
backward's by-hand K/V and down projections, and the matmul count they exist for (ops of a step on meta
tensors, no timing)."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError, StreamConfig
from streambp_core.engine.stream.linear_grads import hand_linear, linear_backward
from streambp_core.engine.stream.rope import Rope, rope_transpose, rotate
from streambp_core.models.load import build_model, tiny_config
from streambp_core.step.estimate.ops import OpRecorder
from streambp_core.verify.methods import VerifySpec
from tests.unit.test_exactness import assert_matches_plain, batch, model_of, relative_errors
from tests.unit.test_objectives import grpo_inputs

DPO_INPUTS = {"ref_chosen_logps": torch.tensor([-40.0, -35.0]),
              "ref_rejected_logps": torch.tensor([-38.0, -37.0]), "beta": 0.5}


@pytest.mark.parametrize("head_mode", ["fused", "recompute"])
@pytest.mark.parametrize("family", ["qwen3", "llama"])
def test_head_modes_exact(family, head_mode):
    model = model_of(family, tie_word_embeddings=family == "llama")
    ids, mask = batch(model.config.vocab_size, 2, 17, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=4, head_partition_size=5,
                         head_mode=head_mode)


def test_fused_head_across_norm_blocks_exact():
    """17 one-token chunks: two blocks of the final norm (16 chunks, then 1), padding in both."""
    model = model_of("qwen3")
    ids, mask = batch(model.config.vocab_size, 2, 17, "left")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=6, head_partition_size=1,
                         head_mode="fused")


def test_fused_head_of_any_module_exact():
    """A head that is not a bias-free nn.Linear takes the fused path through autograd."""
    model = model_of("llama")
    config = model.config
    model.lm_head = torch.nn.Linear(config.hidden_size, config.vocab_size, bias=True, dtype=torch.float64)
    ids, mask = batch(config.vocab_size, 2, 13, "right")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=4, head_partition_size=5,
                         head_mode="fused")


@pytest.mark.parametrize("objective", ["grpo", "dpo"])
def test_fused_and_recomputing_heads_agree(objective):
    """grpo fuses under 'auto'; dpo recomputes; both equal the recomputing head to float64 rounding."""
    model = model_of("qwen3")
    ids, mask = batch(model.config.vocab_size, 4, 13, "left")
    inputs = grpo_inputs(ids, mask) if objective == "grpo" else DPO_INPUTS
    grads = {}
    for mode in ("auto", "recompute"):
        model.zero_grad(set_to_none=True)
        with streambp_core.prepare(model, "streambp", objective=objective, partition_size=4,
                                   head_partition_size=3, head_mode=mode) as run:
            run.loss(ids, attention_mask=mask, **inputs).backward()
        grads[mode] = {n: p.grad.clone() for n, p in model.named_parameters()}
    assert max(relative_errors(grads["auto"], grads["recompute"]).values()) <= 1e-12


def test_fused_head_touches_grad_only_in_backward_and_scales_by_incoming_gradient():
    model = model_of("qwen3")
    ids, _ = batch(model.config.vocab_size, 2, 11, "none")
    grads = {}
    for mode, scale in (("fused", 1.0), ("fused", 4.0), ("recompute", 4.0)):
        model.zero_grad(set_to_none=True)
        with streambp_core.prepare(model, "streambp", head_partition_size=4, head_mode=mode) as run:
            loss = run.loss(ids)
            assert all(p.grad is None for p in model.parameters())
            (scale * loss).backward()
        grads[mode, scale] = {n: p.grad.clone() for n, p in model.named_parameters()}
    # a power of two, so scaling commutes with the float32 steps of the model (its RMSNorm, sft's logits)
    scaled = {n: 4.0 * g for n, g in grads["fused", 1.0].items()}
    assert max(relative_errors(grads["fused", 4.0], scaled).values()) == 0.0
    assert max(relative_errors(grads["fused", 4.0], grads["recompute", 4.0]).values()) <= 1e-12


def test_fused_head_refuses_a_second_backward():
    model = model_of("llama")
    ids, _ = batch(model.config.vocab_size, 1, 9, "none")
    with streambp_core.prepare(model, "streambp", head_mode="fused") as run:
        loss = run.loss(ids)
        loss.backward(retain_graph=True)
        with pytest.raises(RuntimeError, match="applies its gradients once"):
            loss.backward()


def test_head_mode_choices():
    with pytest.raises(ConfigError, match="head_mode"):
        StreamConfig(head_mode="fast")
    with pytest.raises(ConfigError, match="head_mode"):
        VerifySpec.of(model="tiny/qwen3", head_mode="fast")
    model = model_of("llama")
    with pytest.raises(ConfigError, match="dpo takes 'recompute'"):
        streambp_core.prepare(model, "streambp", objective="dpo", head_mode="fused")


def test_rope_transpose_is_the_vjp_of_rope():
    gen = torch.Generator().manual_seed(0)
    k = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=gen, requires_grad=True)
    cos, sin = torch.randn(2, 2, 5, 8, dtype=torch.float64, generator=gen).unbind(1)
    grad = torch.randn(2, 3, 5, 8, dtype=torch.float64, generator=gen)
    rope = Rope.of(cos, sin)
    (expected,) = torch.autograd.grad(rotate(k, rope), k, grad)
    torch.testing.assert_close(rope_transpose(grad, rope), expected, rtol=1e-14, atol=1e-14)


def test_rope_rotates_bit_for_bit_as_transformers():
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    gen = torch.Generator().manual_seed(2)
    q, k = torch.randn(2, 2, 3, 5, 8, dtype=torch.bfloat16, generator=gen).unbind(0)
    cos, sin = torch.randn(2, 2, 5, 8, dtype=torch.bfloat16, generator=gen).unbind(0)
    expected_q, expected_k = apply_rotary_pos_emb(q, k, cos, sin)
    rope = Rope.of(cos, sin)
    assert torch.equal(rotate(q, rope), expected_q) and torch.equal(rotate(k, rope), expected_k)


@pytest.mark.parametrize("family", ["glm4", "ernie4_5", "glm4_moe"])
def test_interleaved_partial_and_float32_rope_are_transformers_bit_for_bit(family):
    """GLM-4 (interleaved pairs of the first half of each head), ERNIE 4.5 (interleaved, in float32 with
    float32 tables) and GLM-4.5 (halves of the first half): the rotation and its transpose equal
    transformers' `apply_rotary_pos_emb` and its autograd backward exactly, in float64."""
    import importlib

    from streambp_core.models.families import family_of

    apply = importlib.import_module(f"transformers.models.{family}.modeling_{family}").apply_rotary_pos_emb
    rows = family_of(family)
    gen = torch.Generator().manual_seed(3)
    q, k = torch.randn(2, 2, 3, 5, 8, dtype=torch.float64, generator=gen).unbind(0)
    table = torch.float32 if rows.rope_in_float32 else torch.float64
    width = 8 if family == "ernie4_5" else 4
    cos, sin = torch.randn(2, 2, 5, width, generator=gen).to(table).unbind(0)
    k = k.requires_grad_(True)
    expected_q, expected_k = apply(q, k, cos, sin)
    grad = torch.randn(expected_k.shape, dtype=torch.float64, generator=gen)
    (expected_grad,) = torch.autograd.grad(expected_k, k, grad)
    rope = Rope.of(cos, sin, interleaved=rows.rope_interleaved, in_float32=rows.rope_in_float32)
    assert torch.equal(rotate(q, rope), expected_q) and torch.equal(rotate(k.detach(), rope), expected_k)
    assert torch.equal(rope_transpose(grad, rope), expected_grad)


def test_linear_backward_accumulates_like_autograd():
    gen = torch.Generator().manual_seed(1)
    layer = torch.nn.Linear(6, 4, dtype=torch.float64)
    x = torch.randn(2, 3, 6, dtype=torch.float64, generator=gen)
    grad = torch.randn(2, 3, 4, dtype=torch.float64, generator=gen)
    x_leaf = x.clone().requires_grad_(True)
    layer(x_leaf).backward(grad)
    expected = (x_leaf.grad, layer.weight.grad.clone(), layer.bias.grad.clone())
    grad_x = linear_backward(layer, x, grad)  # accumulates onto the grads autograd left
    torch.testing.assert_close(grad_x, expected[0])
    torch.testing.assert_close(layer.weight.grad, 2 * expected[1])
    torch.testing.assert_close(layer.bias.grad, 2 * expected[2])


def test_hand_linear_matches_autograd_and_adds_into_grad_in_place():
    """Two chunks through hand_linear: dx per chunk and the summed dW/db as autograd's; the second chunk
    adds into the same `.grad` storage (no weight-sized temporary replaces it)."""
    gen = torch.Generator().manual_seed(2)
    layer = torch.nn.Linear(6, 4, dtype=torch.float64)
    xs = [torch.randn(2, 3, 6, dtype=torch.float64, generator=gen) for _ in range(2)]
    grads = [torch.randn(2, 3, 4, dtype=torch.float64, generator=gen) for _ in range(2)]
    reference = torch.nn.Linear(6, 4, dtype=torch.float64)
    reference.load_state_dict(layer.state_dict())
    storages = []
    for x, grad in zip(xs, grads, strict=True):
        mine, theirs = x.clone().requires_grad_(True), x.clone().requires_grad_(True)
        hand_linear(layer, mine).backward(grad)
        reference(theirs).backward(grad)
        torch.testing.assert_close(mine.grad, theirs.grad, rtol=1e-13, atol=0)
        storages.append(layer.weight.grad.data_ptr())
    torch.testing.assert_close(layer.weight.grad, reference.weight.grad, rtol=1e-13, atol=0)
    torch.testing.assert_close(layer.bias.grad, reference.bias.grad, rtol=1e-13, atol=0)
    assert storages[0] == storages[1]


def test_hand_linear_leaves_other_cases_to_the_module():
    layer = torch.nn.Linear(3, 2)
    x = torch.randn(1, 3)
    assert hand_linear(layer, x).grad_fn.name() != "_HandLinearBackward"  # input takes no gradient
    assert hand_linear(layer, x.requires_grad_(True)).grad_fn.name() == "_HandLinearBackward"
    with torch.no_grad():
        assert hand_linear(layer, x).grad_fn is None
    wrapped = torch.nn.Sequential(layer)
    assert hand_linear(wrapped, x).grad_fn.name() != "_HandLinearBackward"


@pytest.mark.parametrize("family", ["qwen3", "llama"])
@pytest.mark.parametrize("partition_size", [16, 7])
def test_streambp_multiplies_no_more_than_checkpointing(family, partition_size):
    """Matmul FLOPs of one step on meta tensors: streambp (fused head, as 'auto' gives sft) <= checkpoint."""
    model = build_model(tiny_config(family), dtype=torch.bfloat16, device="meta")
    ids = torch.zeros(1, 48, dtype=torch.long, device="meta")
    flops = {}
    for method in ("checkpoint", "streambp"):
        options = {"partition_size": partition_size, "head_partition_size": 8}
        if method == "streambp":
            options["head_mode"] = "auto"
        with streambp_core.prepare(model, method, **options) as run:
            with OpRecorder() as recorder:
                run.loss(ids).backward()
        model.zero_grad(set_to_none=True)
        flops[method] = recorder.matmul_flops()
    assert 0 < flops["streambp"] <= flops["checkpoint"]
