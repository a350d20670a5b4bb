"""Float64 exactness: every method's loss and every parameter gradient equal plain backprop's."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import streambp_core
from streambp_core.models.families import TINY_FAMILIES
from streambp_core.models.load import build_model, tiny_config

GRAD_RTOL = 1e-12
LOSS_RTOL = 1e-12  # a float64 model's loss is float64 for every method, plain included


def batch(vocab: int, batch_size: int, seq_len: int, padding: str, seed: int = 1):
    """Random ids and a mask whose rows carry different amounts of padding on `padding`'s side."""
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (batch_size, seq_len), generator=gen)
    mask = torch.ones(batch_size, seq_len, dtype=torch.long)
    for row in range(batch_size):
        pad = (row * 3 + 2) % max(seq_len // 3, 1) if padding != "none" else 0
        if pad and padding == "right":
            mask[row, seq_len - pad :] = 0
        elif pad and padding == "left":
            mask[row, :pad] = 0
    return ids, mask


def step(model, method: str, ids, mask, labels=None, **options):
    """Loss and a copy of every gradient after one prepared step (a parameter no gradient reached, such as a
    sparse-attention indexer's, has none)."""
    model.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, **options) as run:
        loss = run.loss(ids, attention_mask=mask, labels=labels)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads


def assert_matches_plain(model, ids, mask, labels=None, methods=("checkpoint", "mst", "streambp"), **options):
    ref_loss, ref = step(model, "plain", ids, mask, labels)
    for method in methods:
        loss, grads = step(model, method, ids, mask, labels, **options)
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss), method
        assert grads.keys() == ref.keys()
        for name, err in relative_errors(grads, ref).items():
            assert err <= GRAD_RTOL, f"{method}: {name} relative error {err:.2e}"


def assert_padded_rows_match_plain(model, padding: str, seq_len: int, methods=("streambp",),
                                   partition_size: int = 8) -> None:
    """`methods` give plain's loss and gradients on 2 rows of `seq_len` tokens padded on `padding`'s side
    (`batch`), in chunks of `partition_size` tokens through the layers and of 8 through the head."""
    ids, mask = batch(model.config.vocab_size, 2, seq_len, padding)
    assert_matches_plain(model, ids, mask, methods=methods, partition_size=partition_size,
                         head_partition_size=8)


def relative_errors(grads, ref):
    """||g - g_plain|| / ||g_plain|| per parameter. A gradient that is zero in exact arithmetic (q_proj when
    every query sees one key, T=2) holds only rounding noise, so norms are floored at 1e-3 of the largest."""
    floor = 1e-3 * max(g.norm() for g in ref.values())
    return {n: ((g - ref[n]).norm() / torch.clamp(ref[n].norm(), min=floor)).item() for n, g in grads.items()}


def model_of(family: str, **overrides):
    return build_model(tiny_config(family, **overrides), dtype=torch.float64, seed=0)


COVERED_WITH_WINDOWS = ("gemma3", "qwen3-moe", "mixtral")
"""Families whose padded float64 matrix runs in test_models_coverage.py, with windows shorter than it."""
COVERED_IN_THEIR_FILES = ("gpt-oss", "gemma2", "llama4", "qwen3.5", "qwen3.5-moe", "qwen3-next")
"""Families whose own test file (tests/unit/test_family_*.py) runs every method against plain in float64
with left and right padding, at 1e-12, beside what sets the family apart."""


PADDED_FAMILIES = [f for f in TINY_FAMILIES if f not in COVERED_WITH_WINDOWS + COVERED_IN_THEIR_FILES]
"""The families test_each_family_with_padding runs: by default each with one padding side, the sides
alternating down the list; the other side of each under -m slow."""


@pytest.mark.parametrize(("family", "padding"), [
    pytest.param(family, padding, marks=() if (index + side) % 2 == 0 else pytest.mark.slow)
    for index, family in enumerate(PADDED_FAMILIES) for side, padding in enumerate(("right", "left"))])
def test_each_family_with_padding(family, padding):
    model = model_of(family)
    ids, mask = batch(model.config.vocab_size, 2, 23, padding)
    assert_matches_plain(model, ids, mask, partition_size=5, head_partition_size=4)


@pytest.mark.parametrize(
    "overrides",
    [
        {"tie_word_embeddings": True},
        {"tie_word_embeddings": False},
        {"num_key_value_heads": 1},  # MQA
        {"num_attention_heads": 4, "num_key_value_heads": 4},  # no grouping
        {"head_dim": 24},  # head_dim != hidden / heads
        {"attention_bias": True},
    ],
    ids=["tied", "untied", "mqa", "mha", "head_dim", "qkv_bias"],
)
def test_architecture_variants(overrides):
    model = model_of("llama", **overrides)
    ids, mask = batch(model.config.vocab_size, 2, 19, "right")
    assert_matches_plain(model, ids, mask, partition_size=6, head_partition_size=7)


@pytest.mark.parametrize("partition_size", [1, 7, 19, 64], ids=["one", "not_a_divisor", "equal", "larger"])
def test_partition_sizes(partition_size):
    model = model_of("qwen3")
    ids, mask = batch(model.config.vocab_size, 2, 19, "left")
    assert_matches_plain(
        model,
        ids,
        mask,
        methods=("streambp", "mst"),
        partition_size=partition_size,
        head_partition_size=partition_size,
    )


def test_prompt_masked_labels_and_no_mask():
    """Labels ignored on a prompt prefix (chunk starts on ignored labels), and attention_mask=None."""
    model = model_of("qwen3")
    ids, _ = batch(model.config.vocab_size, 2, 21, "none")
    labels = ids.clone()
    labels[0, :9] = -100
    labels[1, :4] = -100
    assert_matches_plain(model, ids, None, labels, partition_size=4, head_partition_size=3)


def test_left_padding_row_fully_masked_predicts_first_token():
    """The last padding position predicts the first real token from a fully masked attention row."""
    model = model_of("llama")
    ids, mask = batch(model.config.vocab_size, 2, 16, "left")
    labels = ids.clone()  # standard labels: padding positions are *not* ignored here
    assert_matches_plain(model, ids, mask, labels, methods=("streambp",), partition_size=3)


@settings(max_examples=12, deadline=None)
@given(
    family=st.sampled_from(["llama", "qwen2", "qwen3", "mistral"]),
    kv_heads=st.sampled_from([1, 2, 4]),
    seq_len=st.integers(min_value=2, max_value=30),
    batch_size=st.integers(min_value=1, max_value=3),
    partition=st.integers(min_value=1, max_value=32),
    head_partition=st.integers(min_value=1, max_value=32),
    padding=st.sampled_from(["none", "right", "left"]),
    tied=st.booleans(),
)
def test_property_random_configs(
    family, kv_heads, seq_len, batch_size, partition, head_partition, padding, tied
):
    model = model_of(
        family,
        num_attention_heads=4,
        num_key_value_heads=kv_heads,
        tie_word_embeddings=tied,
        hidden_size=32,
        intermediate_size=40,
        vocab_size=61,
    )
    ids, mask = batch(61, batch_size, seq_len, padding)
    assert_matches_plain(
        model, ids, mask, methods=("streambp",), partition_size=partition, head_partition_size=head_partition
    )


@pytest.mark.parametrize("method", ["plain", "checkpoint", "mst", "streambp"])
def test_close_restores_the_model(method):
    model = model_of("qwen3")
    before = {n: p.detach().clone() for n, p in model.state_dict().items()}
    modules_before = [(name, type(m), dict(vars(m)).keys()) for name, m in model.named_modules()]
    attn_before = model.config._attn_implementation
    ids, mask = batch(model.config.vocab_size, 1, 12, "none")
    with streambp_core.prepare(model, method, partition_size=4, baseline_attention="engine") as run:
        run.loss(ids, attention_mask=mask).backward()
    assert model.config._attn_implementation == attn_before
    assert not any(getattr(m, "gradient_checkpointing", False) for m in model.modules())
    assert not hasattr(model, "_require_grads_hook")
    assert [(name, type(m), dict(vars(m)).keys()) for name, m in model.named_modules()] == modules_before
    after = model.state_dict()
    assert all(torch.equal(after[n], t) for n, t in before.items())
    with pytest.raises(RuntimeError, match="closed"):
        run.loss(ids)


ENGINE_ATTENTION_DEFAULT = ("qwen3", "gemma2", "gpt-oss", "llama4", "deepseek-v3", "qwen3.5")
"""The families test_the_engine_attention_is_the_models runs by default, one an attention feature (plain
causal, soft caps, sinks, chunked local layers, latent attention's narrower values, a hybrid's gated
attention); every other family under -m slow."""


@pytest.mark.parametrize("family", [
    pytest.param(family, marks=() if family in ENGINE_ATTENTION_DEFAULT else pytest.mark.slow)
    for family in TINY_FAMILIES])
def test_the_engine_attention_is_the_models(family):
    """plain with transformers' layers attending through the engine kernel (the baselines' attention in
    every simulation) is plain with the model's own attention, for every family: soft caps, sinks, chunked
    local layers, latent attention's narrower values, left padding, 40 tokens."""
    model = model_of(family)
    ids, mask = batch(model.config.vocab_size, 2, 40, "left")
    ref_loss, ref = step(model, "plain", ids, mask)
    loss, grads = step(model, "plain", ids, mask, baseline_attention="engine")
    assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
    assert max(relative_errors(grads, ref).values()) <= GRAD_RTOL


def test_the_baselines_through_the_engine_attention_match_plain():
    """checkpoint and mst through the engine kernel, in chunks, give plain's gradients too."""
    model = model_of("qwen2")
    ids, mask = batch(model.config.vocab_size, 2, 17, "left")
    ref_loss, ref = step(model, "plain", ids, mask)
    for method in ("checkpoint", "mst"):
        loss, grads = step(model, method, ids, mask, baseline_attention="engine", partition_size=5)
        assert abs(loss - ref_loss) <= LOSS_RTOL * abs(ref_loss)
        assert max(relative_errors(grads, ref).values()) <= GRAD_RTOL


def test_preparing_does_not_copy_weights():
    model = model_of("qwen3")
    pointers = [p.data_ptr() for p in model.parameters()]
    for method in ("plain", "checkpoint", "mst", "streambp"):
        with streambp_core.prepare(model, method):
            assert [p.data_ptr() for p in model.parameters()] == pointers


@pytest.mark.parametrize(
    ("options", "message"),
    [
        ({"partition_size": 0}, "partition_size"),
        ({"head_partition_size": -3}, "head_partition_size"),
        ({"attn": "xformers"}, "attn"),
        ({"bogus": 1}, "unknown option"),
    ],
)
def test_bad_options_are_config_errors(options, message):
    model = model_of("qwen3")
    with pytest.raises(streambp_core.ConfigError, match=message):
        streambp_core.prepare(model, "streambp", **options)


def test_unknown_method_and_short_sequence():
    model = model_of("qwen3")
    with pytest.raises(streambp_core.ConfigError, match="unknown method"):
        streambp_core.prepare(model, "zero-bubble")
    with streambp_core.prepare(model, "streambp") as run:
        with pytest.raises(streambp_core.ConfigError, match="at least 2"):
            run.loss(torch.zeros(1, 1, dtype=torch.long))
