"""Sliding-window attention, Gemma 3 and mixture-of-experts: every method equals plain backprop in float64,
with windows shorter than the sequence, padding on either side, batch > 1 and uneven chunks; features the
engine cannot run exactly are refused by name."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.engine.attention.prefix import prefix_attention
from streambp_core.engine.chunks import allowed_mask, window_start
from streambp_core.models import build_model, load_config, tiny_config
from streambp_core.models.adapters import decoder_parts, layer_parts
from streambp_core.verify.methods import VerifySpec, verify_spec
from tests.unit.test_exactness import assert_matches_plain, batch, step

WINDOW = 6
"""Sliding window of the tests' local layers: shorter than their sequences (23 tokens) and than a chunk
plus its band, so chunks see a strict part of their prefix."""

MODELS = {
    "gemma3": ("gemma3", {"sliding_window": WINDOW}),  # layer 0 local, layer 1 global
    "qwen3-moe": ("qwen3-moe", {}),
    "mixtral": ("mixtral", {"sliding_window": WINDOW}),  # one window for every layer
    "mistral-window": ("mistral", {"sliding_window": WINDOW}),
    "qwen2-hybrid": ("qwen2", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
    "qwen3-hybrid": ("qwen3", {"use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1}),
}


def model_of(name: str, **extra):
    family, overrides = MODELS[name]
    return build_model(tiny_config(family, **{**overrides, **extra}), dtype=torch.float64, seed=0)


@pytest.mark.parametrize(
    ("name", "padding"),
    [("gemma3", "right"), ("gemma3", "left"), ("qwen3-moe", "right"), ("mixtral", "left"),
     ("mistral-window", "right"), ("qwen2-hybrid", "left"), ("qwen3-hybrid", "right")],
)
def test_every_method_matches_plain(name, padding):
    """Batch 3, 23 tokens, layer chunks of 5 (not a divisor) and head chunks of 4."""
    model = model_of(name)
    ids, mask = batch(model.config.vocab_size, 3, 23, padding)
    assert_matches_plain(model, ids, mask, partition_size=5, head_partition_size=4)


@pytest.mark.parametrize(
    ("model", "objective"),
    [("tiny/gemma3", "grpo"), ("tiny/gemma3", "dpo"), ("tiny/qwen3-moe", "dpo"), ("tiny/mixtral", "grpo")],
)
def test_verify_passes_for_the_rl_objectives(model, objective):
    """The verify machinery (every method vs plain, float64, 1e-10) with left padding, batch 2 and 30 tokens
    in chunks of 7: the tiny presets' windows (8) are shorter than the sequence. (Qwen3-MoE with grpo and
    Mixtral with dpo: `test_router_load_balancing_loss_is_exact`.)"""
    spec = VerifySpec.of(model=model, dtype="float64", objective=objective, seq_len_tokens=30, batch_size=2,
                         partition_size=7, head_partition_size=9, padding="left")
    report = verify_spec(spec)
    assert report.ok, [(r.method, r.max_rel_err, r.worst_param, r.loss_abs_err) for r in report.results]
    assert {r.method for r in report.results} == {"checkpoint", "mst", "streambp"}


def test_hybrid_layers_have_their_own_window_and_rope_table():
    parts = [layer_parts(layer) for layer in model_of("gemma3").model.layers]
    assert [p.sliding_window for p in parts] == [WINDOW, None]
    assert [p.rope_key for p in parts] == ["sliding_attention", "full_attention"]
    assert [p.attn_out_norm is not None and p.mlp_out_norm is not None for p in parts] == [True, True]
    assert parts[0].scaling == load_config("tiny/gemma3").query_pre_attn_scalar ** -0.5
    qwen2 = [layer_parts(layer).sliding_window for layer in model_of("qwen2-hybrid").model.layers]
    assert qwen2 == [None, WINDOW]


def test_local_and_global_rope_tables_differ():
    model = model_of("gemma3")
    hidden = torch.zeros(1, 5, 64, dtype=torch.float64)
    tables = decoder_parts(model).rope_tables(hidden, torch.arange(5)[None])
    (cos_local, _), (cos_global, _) = tables["sliding_attention"], tables["full_attention"]
    assert not torch.allclose(cos_local, cos_global)


@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_the_window_changes_the_loss(name):
    """A check that can fail: the same weights without a window (or a window covering the sequence) give
    another loss, so the exactness tests above do exercise the band."""
    ids, mask = batch(512, 2, 23, "none")
    losses = []
    for window in (WINDOW, 64):
        loss, _ = step(model_of(name, sliding_window=window), "streambp", ids, mask, partition_size=5)
        losses.append(float(loss))
    assert abs(losses[0] - losses[1]) > 1e-6


@pytest.mark.parametrize("name", ["gemma3", "mistral-window"])
def test_engine_attention_in_baselines_applies_the_window(name):
    """The baselines on the engine kernel (as on the meta device) equal transformers' own attention with
    its sliding-window masks, under left padding."""
    model = model_of(name)
    ids, mask = batch(model.config.vocab_size, 2, 23, "left")
    ref_loss, ref = step(model, "plain", ids, mask, baseline_attention="model")
    loss, grads = step(model, "plain", ids, mask, baseline_attention="engine")
    assert abs(float(loss - ref_loss)) <= 1e-12 * abs(float(ref_loss))
    for param_name, grad in grads.items():
        assert torch.allclose(grad, ref[param_name], rtol=1e-10, atol=1e-13), param_name


def test_banded_kernel_matches_a_dense_band_mask():
    """The exact kernel with a window equals softmax over the lower-right band written out by hand, for a
    chunk of 3 queries that are the last of 9 keys, with padding."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 3, 8, generator=gen, dtype=torch.float64)
    k, v = (torch.randn(2, 2, 9, 8, generator=gen, dtype=torch.float64) for _ in range(2))
    valid = torch.ones(2, 9, dtype=torch.bool)
    valid[1, :3] = False
    got = prefix_attention(q, k, v, valid, 0.3, window=4)
    rows = torch.arange(6, 9)[:, None]
    band = (torch.arange(9)[None] <= rows) & (torch.arange(9)[None] > rows - 4)
    assert torch.equal(allowed_mask(3, valid, window=4), band[None] & valid[:, None])
    scores = q @ k.repeat_interleave(2, dim=1).transpose(-1, -2) * 0.3
    scores = scores.masked_fill(~(band[None, None] & valid[:, None, None]), float("-inf"))
    want = scores.softmax(dim=-1) @ v.repeat_interleave(2, dim=1)
    assert torch.allclose(got, want, atol=1e-14)
    assert window_start(end=9, num_queries=3, window=4) == 3 and window_start(9, 3, None) == 0


@pytest.mark.parametrize(
    ("family", "overrides", "named"),
    [
        ("gemma3", {"attn_logit_softcapping": 50.0}, "attention logit soft-capping"),
        ("gemma3", {"final_logit_softcapping": 30.0}, "final logit soft-capping"),
        ("gemma3", {"use_bidirectional_attention": True}, "bidirectional attention"),
        ("mixtral", {"router_jitter_noise": 0.1}, "router jitter noise"),
    ],
)
def test_inexact_features_are_refused_by_name(family, overrides, named):
    with pytest.raises(ConfigError, match=named) as error:
        build_model(tiny_config(family, **overrides), dtype=torch.float64)
    assert "\n" not in str(error.value)


@pytest.mark.parametrize(("family", "objective"),
                         [("qwen3-moe", "grpo"), ("mixtral", "dpo"), ("qwen2-moe", "sft")])
def test_router_load_balancing_loss_is_exact(tmp_path, family, objective):
    """With `output_router_logits` (coefficient 0.5, so the loss weighs) plain, checkpoint and streambp
    agree on the loss and every gradient, router weights included; the loss changes the router's
    gradients (a check that can fail); mst refuses it by name."""
    tiny_config(family, output_router_logits=True, router_aux_loss_coef=0.5).save_pretrained(tmp_path)
    spec = VerifySpec.of(model=str(tmp_path), methods=("checkpoint", "streambp"), dtype="float64",
                         seq_len_tokens=26, batch_size=2, partition_size=7, head_partition_size=9,
                         padding="left", objective=objective)
    report = verify_spec(spec)
    assert report.ok, [(r.method, r.max_rel_err, r.worst_param, r.loss_abs_err) for r in report.results]
    ids, mask = batch(512, 2, 21, "right")
    with_aux = build_model(str(tmp_path), dtype=torch.float64)
    without = build_model(tiny_config(family), dtype=torch.float64)
    router = "model.layers.0.mlp.gate.weight"
    grads = [step(model, "streambp", ids, mask, partition_size=5)[1][router] for model in (with_aux, without)]
    assert not torch.allclose(grads[0], grads[1], rtol=1e-3)
    with pytest.raises(ConfigError, match="mst: the router load-balancing loss"):
        streambp_core.prepare(with_aux, "mst")


def test_refusal_also_guards_prepare():
    """A model whose config gained a refused feature after building is refused when prepared."""
    model = model_of("gemma3")
    model.config.final_logit_softcapping = 30.0
    with pytest.raises(ConfigError, match="final logit soft-capping"):
        streambp_core.prepare(model, "streambp")


def test_float64_gemma_norms_stay_float64():
    """Gemma's RMSNorm would round a float64 model to float32; built here it keeps float64, while its
    float32 result is transformers' own."""
    model = build_model("tiny/gemma3", dtype=torch.float64)
    norm = model.model.layers[0].input_layernorm
    x = torch.randn(2, 64, dtype=torch.float64)
    assert norm(x).dtype == torch.float64
    assert not torch.equal(norm(x), type(norm).forward(norm, x))
    x32, norm32 = x.float(), build_model("tiny/gemma3", dtype=torch.float32).model.layers[0].input_layernorm
    assert torch.equal(norm32(x32), type(norm32).forward(norm32, x32))


def test_presets_carry_the_published_windows_and_experts():
    mistral = load_config("mistralai/Mistral-7B-v0.1")
    assert (mistral.sliding_window, mistral.rope_parameters["rope_theta"]) == (4096, 10000.0)
    gemma = load_config("google/gemma-3-27b-it")
    assert (gemma.sliding_window, gemma.query_pre_attn_scalar, gemma.head_dim) == (1024, 168, 128)
    assert gemma.layer_types[:6] == ["sliding_attention"] * 5 + ["full_attention"]
    rope = gemma.rope_parameters
    assert (rope["sliding_attention"]["rope_theta"], rope["full_attention"]["rope_theta"]) == (1e4, 1e6)
    assert (rope["full_attention"]["rope_type"], rope["full_attention"]["factor"]) == ("linear", 8.0)
    assert load_config("google/gemma-3-1b-it").sliding_window == 512
    qwen = load_config("Qwen/Qwen3-30B-A3B")
    assert (qwen.num_experts, qwen.num_experts_per_tok, qwen.moe_intermediate_size) == (128, 8, 768)
    mixtral = load_config("mistralai/Mixtral-8x7B-v0.1")
    assert (mixtral.num_local_experts, mixtral.num_experts_per_tok, mixtral.sliding_window) == (8, 2, None)



@pytest.mark.parametrize("family", ["qwen3-moe", "mixtral"])
def test_a_moe_step_outside_bfloat16_is_refused_by_the_simulator_by_name(family):
    """The experts' grouped matmul has a bfloat16 meta kernel only and their per-expert loop reads token
    values: a float32 MoE step cannot be simulated, and says so (it runs measured on the CPU)."""
    from streambp_core.config import ConfigError, StepSpec
    from streambp_core.step.simulation.simulate import simulate

    spec = StepSpec.of(model=f"tiny/{family}", method="streambp", seq_len_tokens=100, dtype="float32",
                       partition_size=32, head_partition_size=16)
    with pytest.raises(ConfigError, match="mixture-of-experts step is simulated in bfloat16 only"):
        simulate(spec)
    assert simulate(replace(spec, dtype="bfloat16")).peak_bytes > 0
