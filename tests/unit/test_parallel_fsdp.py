"""FSDP2 sharding in this process (a one-rank gloo group, where FSDP skips the collectives): every method
runs on the sharded model, through FSDP's parameter swaps and hooks, with plain's gradients. The
collectives themselves are counted with two ranks in test_parallel_verify.py."""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.engine.engines.fsdp_unit import sharded_forward
from streambp_core.models import build_model, load_config
from streambp_core.parallel.fsdp import full_gradients, shard_model
from streambp_core.step.parts.batch import random_batch
from streambp_core.verify.compare import max_rel_err

SEQ_LEN = 64


@pytest.fixture(scope="module")
def one_rank(tmp_path_factory):
    store = tmp_path_factory.mktemp("rendezvous") / "store"
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.fixture(scope="module")
def tiny():
    model = build_model(load_config("tiny/qwen3"), dtype=torch.float64, device="cpu", seed=0)
    batch = random_batch(vocab_size=model.config.vocab_size, seq_len=SEQ_LEN, batch_size=2, padding="right",
                         seed=1)
    return model, batch


@pytest.fixture(scope="module")
def reference(tiny):
    model, batch = tiny
    return _step(model, "plain", batch)


def _step(model, method, batch, shard=None):
    model = copy.deepcopy(model)
    if shard:
        shard_model(model, shard)
    with streambp_core.prepare(model, method, partition_size=16, head_partition_size=16) as run:
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=batch.labels)
        loss.backward()
    return full_gradients(model)


@pytest.mark.parametrize("method, shard", [("plain", "zero3"), ("checkpoint", "zero3"), ("mst", "zero3"),
                                           ("streambp", "zero3"), ("streambp", "zero2")])
def test_every_method_on_a_sharded_model_has_plains_gradients(one_rank, tiny, reference, method, shard):
    model, batch = tiny
    err, worst = max_rel_err(_step(model, method, batch, shard), reference)
    assert err < 1e-12, worst


def test_sharded_forward_of_an_unsharded_module_is_a_plain_call(tiny):
    model, _ = tiny
    assert sharded_forward(model, lambda x: x + 1, torch.ones(2)).tolist() == [2.0, 2.0]


def test_shard_stage_and_process_group_are_checked(tiny, monkeypatch):
    model, _ = tiny
    with pytest.raises(ConfigError, match="shard must be one of zero2, zero3"):
        shard_model(copy.deepcopy(model), "zero1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    with pytest.raises(ConfigError, match="initialized process group"):
        shard_model(copy.deepcopy(model), "zero2")
