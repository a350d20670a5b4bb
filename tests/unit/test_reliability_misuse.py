"""Misuse is a one-line ConfigError naming the problem, not a raw IndexError or AttributeError."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.integrations import stream_trainer
from streambp_core.models.load import build_model, tiny_config


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
