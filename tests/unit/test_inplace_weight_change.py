"""A weight changed in place between `run.loss()` and `backward()` raises, as plain backprop's saved
tensors make torch raise, for every method: a recomputing method would otherwise return a gradient of
neither the old nor the new weights."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import METHODS
from streambp_core.models.load import build_model, tiny_config

OPTIONS = {"streambp": {"partition_size": 4, "head_partition_size": 4}, "mst": {"partition_size": 4}}


def _loss(method: str, offload: str = "none"):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64)
    run = streambp_core.prepare(model, method, offload=offload, **OPTIONS.get(method, {}))
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(0))
    return model, run, run.loss(ids)


@pytest.mark.parametrize("method", METHODS)
def test_a_weight_changed_after_the_loss_raises_at_backward(method: str) -> None:
    model, run, loss = _loss(method)
    with torch.no_grad():
        model.model.layers[0].mlp.up_proj.weight.mul_(2.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()
    run.close()


@pytest.mark.parametrize("method", ["streambp", "checkpoint"])
def test_offloaded_checkpoints_raise_too(method: str) -> None:
    model, run, loss = _loss(method, offload="checkpoints")
    with torch.no_grad():
        model.model.norm.weight.add_(1.0)
    with pytest.raises(RuntimeError, match="model.norm.weight"):
        loss.backward()
    run.close()


@pytest.mark.parametrize("method", METHODS)
def test_an_unchanged_model_backpropagates_and_a_second_step_works(method: str) -> None:
    model, run, loss = _loss(method)
    loss.backward()
    with torch.no_grad():
        for param in model.parameters():
            param.sub_(0.01 * param.grad)
    ids = torch.randint(0, 512, (1, 12), generator=torch.Generator().manual_seed(1))
    run.loss(ids).backward()  # the weights changed before this loss: no error
    assert all(param.grad is not None for param in model.parameters())
    run.close()
