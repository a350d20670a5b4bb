"""A configured feature is trained or refused by name, never dropped: attention dropout is kept by
build_model (plain and checkpoint train it; streambp and mst refuse it), and peft prompt tuning is refused
by the methods that do not run peft's forward (its virtual tokens would be ignored). Why checkpoint
and mst may keep attention dropout: torch's checkpoint replays the forward's RNG state on recompute."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.models.load import build_model, tiny_config

IDS = torch.randint(0, 512, (1, 16), generator=torch.Generator().manual_seed(0))


def test_build_model_trains_the_configured_attention_dropout() -> None:
    model = build_model(tiny_config("qwen3", attention_dropout=0.5))
    assert model.config.attention_dropout == 0.5
    assert all(layer.self_attn.attention_dropout == 0.5 for layer in model.model.layers)
    with streambp_core.prepare(model, "plain", baseline_attention="model") as run:
        torch.manual_seed(1)
        first = float(run.loss(IDS).detach())
        torch.manual_seed(2)
        second = float(run.loss(IDS).detach())
    assert first != second  # dropout is on: two masks, two losses


def test_a_method_that_cannot_replay_dropout_refuses_it_by_name() -> None:
    model = build_model(tiny_config("qwen3", attention_dropout=0.1))
    with pytest.raises(ConfigError, match=r"streambp cannot train with dropout exactly"):
        streambp_core.prepare(model, "streambp", partition_size=4)


@pytest.mark.parametrize("method", ["checkpoint", "mst"])
def test_methods_whose_attention_recompute_replays_the_masks_train_it(method: str) -> None:
    model = build_model(tiny_config("qwen3", attention_dropout=0.1))
    with streambp_core.prepare(model, method, partition_size=4) as run:
        run.loss(IDS).backward()
    assert all(param.grad is not None for param in model.parameters())


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_prompt_tuning_is_refused_where_its_virtual_tokens_would_be_ignored(method: str) -> None:
    peft = pytest.importorskip("peft")
    config = peft.PromptTuningConfig(task_type="CAUSAL_LM", num_virtual_tokens=4)
    model = peft.get_peft_model(build_model(tiny_config("qwen3")), config)
    with pytest.raises(ConfigError, match=rf"{method} cannot train a peft prompt-learning model"):
        streambp_core.prepare(model, method, partition_size=4)
