"""Library misuse is one ConfigError line, never a NaN, a traceback or a silently different step."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.integrations import stream_trainer
from streambp_core.models.load import build_model, tiny_config

IDS = torch.randint(0, 512, (2, 12), generator=torch.Generator().manual_seed(3))


def _model(dtype=torch.float64, **overrides):
    return build_model(tiny_config("llama", **overrides), dtype=dtype, seed=0)


def _with_attention_dropout(model, rate: float):
    for layer in model.model.layers:
        layer.self_attn.attention_dropout = rate
    return model


def _grads(model, method: str, seed: int = 5, **inputs):
    model.zero_grad(set_to_none=True)
    torch.manual_seed(seed)
    with streambp_core.prepare(model, method, partition_size=5, head_partition_size=4) as run:
        loss = run.loss(IDS, **inputs)
        loss.backward()
    return loss.detach(), {name: param.grad.clone() for name, param in model.named_parameters()}


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_dropout_a_method_cannot_replay_is_refused_by_name(method):
    model = _with_attention_dropout(_model(), 0.1) if method == "streambp" else _model()
    if method == "mst":
        model.lm_head = nn.Sequential(model.lm_head, nn.Dropout(0.2))
    with pytest.raises(ConfigError, match=rf"{method} cannot train with dropout exactly .*in train mode"):
        streambp_core.prepare(model, method)


def test_dropout_with_the_engine_attention_is_refused_for_the_baselines():
    model = _with_attention_dropout(_model(), 0.1)
    with pytest.raises(ConfigError, match=r"attention_dropout p=0.1"):
        streambp_core.prepare(model, "checkpoint", baseline_attention="engine")


def test_checkpoint_replays_dropout_so_its_gradients_are_plains():
    model = _with_attention_dropout(_model(), 0.3)
    ref_loss, ref = _grads(model, "plain")
    loss, grads = _grads(model, "checkpoint")
    _, other_masks = _grads(model, "plain", seed=6)
    assert torch.equal(loss, ref_loss)
    assert all(torch.allclose(grads[name], ref[name], rtol=1e-12, atol=0) for name in ref)
    assert not all(torch.allclose(other_masks[name], ref[name]) for name in ref)  # dropout is on


def test_dropout_is_allowed_in_eval_mode_and_streambp_then_matches_plain():
    model = _with_attention_dropout(_model(), 0.3).eval()
    ref_loss, ref = _grads(model, "plain")
    loss, grads = _grads(model, "streambp")
    assert torch.allclose(loss, ref_loss, rtol=1e-12)
    assert all(torch.allclose(grads[name], ref[name], rtol=1e-10, atol=1e-14) for name in ref)


def test_checkpoint_still_checkpoints_a_model_in_eval_mode():
    model = _model().eval()
    calls = []
    mlp = model.model.layers[0].mlp
    forward = mlp.forward
    mlp.forward = lambda x: (calls.append(1), forward(x))[1]  # a hook there is refused (test_hooks)
    _grads(model, "checkpoint")
    assert len(calls) == 2  # forward, then the recompute in backward
    assert not any(module.training for module in model.modules())  # eval restored on close
    calls.clear()
    _grads(model, "plain")
    assert len(calls) == 1


def test_a_second_prepare_while_the_first_run_is_open_is_refused():
    model = _model()
    first = streambp_core.prepare(model, "checkpoint")
    with pytest.raises(ConfigError, match="already prepared for checkpoint"):
        streambp_core.prepare(model, "streambp")
    first.close()
    with streambp_core.prepare(model, "streambp") as second:
        assert not second.closed
    assert second.closed


@pytest.mark.parametrize("method", ["plain", "checkpoint", "mst", "streambp"])
def test_all_labels_ignored_is_an_error_not_nan(method):
    labels = torch.full_like(IDS, -100)
    labels[:, 0] = IDS[:, 0]  # the first label is never a target (shifted away)
    with streambp_core.prepare(_model(), method) as run:
        with pytest.raises(ConfigError, match="every label is -100"):
            run.loss(IDS, labels=labels)


@pytest.mark.parametrize(
    ("module", "message"),
    [(nn.Linear(4, 4), "got Linear"), (build_model("tiny/qwen3").model, "Qwen3Model has no")],
)
def test_prepare_on_something_other_than_a_causal_lm_is_a_config_error(module, message):
    with pytest.raises(ConfigError, match=message):
        streambp_core.prepare(module, "streambp")


@pytest.mark.parametrize(
    ("ids", "message"),
    [
        (torch.zeros(0, 8, dtype=torch.long), "batch is empty"),
        (torch.zeros(2, 0, dtype=torch.long), "seq_len must be at least 2"),
        (torch.zeros(1, 8), "integer token ids"),
        (torch.full((1, 8), 512), r"outside the vocabulary 0..511"),
    ],
)
def test_an_empty_or_invalid_batch_is_a_config_error(ids, message):
    with streambp_core.prepare(_model(), "streambp") as run, pytest.raises(ConfigError, match=message):
        run.loss(ids)


def test_a_float64_model_loss_is_computed_in_float64_by_every_method():
    model = _model()
    logits = model(input_ids=IDS).logits
    expected = F.cross_entropy(logits[:, :-1].flatten(0, 1), IDS[:, 1:].flatten())
    assert logits.dtype == torch.float64
    for method in ("plain", "checkpoint", "mst", "streambp"):
        with streambp_core.prepare(model, method) as run:
            loss = run.loss(IDS)
        assert loss.dtype == torch.float64
        assert abs(loss.item() - expected.item()) <= 1e-13 * expected.item(), method


def test_lora_wrapping_raises_no_deprecation_warning_from_transformers():
    import warnings

    from streambp_core.models.lora import apply_lora

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        apply_lora(_model(torch.float32), 4)
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)]


@pytest.mark.parametrize("method", ["plain", "streambp"])
@pytest.mark.parametrize("label", [512, 10_000, -5])
def test_labels_outside_the_vocabulary_are_named(method: str, label: int) -> None:
    model = build_model(tiny_config("qwen3"))
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, 3] = label
    options = {"partition_size": 4, "head_partition_size": 4} if method == "streambp" else {}
    with streambp_core.prepare(model, method, **options) as run, pytest.raises(ConfigError, match=str(label)):
        run.loss(ids, labels=labels)


def test_ignored_labels_are_still_fine() -> None:
    model = build_model(tiny_config("qwen3"))
    ids = torch.randint(0, 512, (1, 8), generator=torch.Generator().manual_seed(0))
    labels = ids.clone()
    labels[0, :3] = -100
    with streambp_core.prepare(model, "streambp", partition_size=4, head_partition_size=4) as run:
        assert torch.isfinite(run.loss(ids, labels=labels))


@pytest.mark.parametrize("trainer", [object(), None, "trainer"])
def test_stream_trainer_names_what_it_takes(trainer) -> None:
    with pytest.raises(ConfigError, match="takes a transformers Trainer or a TRL trainer"):
        stream_trainer(trainer)
