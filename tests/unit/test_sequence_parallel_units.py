"""Sequence parallelism without ranks: lockstep chunks, KV head replication, a simulated group's step on
the meta device through every method (what the simulator runs), what is refused by name, and a run that
leaves the model as it found it."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import METHODS, ConfigError, StepSpec
from streambp_core.engine.sequence.attention import kv_replication, lockstep_chunks
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.engine.sequence.hf import GROUP_ATTRIBUTE
from streambp_core.models import build_model, load_config


@pytest.mark.parametrize(("total", "size", "partition"), [(37, 2, 8), (32, 4, 8), (33, 4, 8), (9, 4, 100)])
def test_every_rank_runs_as_many_chunks_whose_sizes_are_those_of_their_sum(total, size, partition):
    group = SequenceGroup.simulated(size)
    chunks = lockstep_chunks(group, total, partition)
    assert len(chunks) == -(-max(group.shard_sizes(total)) // partition)
    covered = [0] * size
    for blocks in chunks:
        assert blocks.sizes == group.shard_sizes(sum(blocks.sizes))  # what the all-to-alls assume
        for rank, (start, end) in enumerate(blocks.bounds):
            assert start == covered[rank] or start == end
            covered[rank] = end
    assert covered == group.shard_sizes(total)


def test_thinned_chunks_are_the_same_indices_on_every_rank():
    chunks = lockstep_chunks(SequenceGroup.simulated(2), 100, 5, keep_chunks=1)
    assert [blocks.bounds for blocks in chunks] == [((0, 5), (0, 5)), ((45, 50), (45, 50))]


@pytest.mark.parametrize(("heads", "kv_heads", "size", "copies"),
                         [(32, 8, 8, 1), (32, 8, 16, 2), (4, 2, 4, 2), (4, 1, 2, 2), (64, 8, 32, 4)])
def test_kv_heads_are_replicated_until_they_split_like_the_query_heads(heads, kv_heads, size, copies):
    assert kv_replication(heads, kv_heads, size) == copies


@pytest.mark.parametrize(("heads", "kv_heads", "size", "words"),
                         [(6, 2, 4, "6 attention heads do not split over 4"),
                          (8, 3, 4, "3 KV heads cannot be replicated")])
def test_heads_that_cannot_split_are_refused_by_name(heads, kv_heads, size, words):
    with pytest.raises(ConfigError, match=words):
        kv_replication(heads, kv_heads, size)


@pytest.fixture(scope="module")
def meta_model():
    return build_model(load_config("tiny/qwen3"), dtype=torch.bfloat16, device="meta", seed=0)


@pytest.mark.parametrize("method", METHODS)
def test_a_simulated_rank_runs_every_method_on_meta(meta_model, method):
    ids = torch.zeros(1, 1000, dtype=torch.long, device="meta")
    offload = "none" if method == "plain" else "checkpoints"
    with streambp_core.prepare(meta_model, method, partition_size=64, head_partition_size=32, keep_chunks=1,
                               offload=offload, sequence_group=SequenceGroup.simulated(4)) as run:
        loss = run.loss(ids)
        loss.backward()
    assert loss.device.type == "meta" and loss.shape == ()
    grads = [p.grad for p in meta_model.parameters()]
    assert all(g is not None and g.device.type == "meta" for g in grads)
    for param in meta_model.parameters():
        param.grad = None


@pytest.fixture
def cpu_model():
    return build_model(load_config("tiny/llama"), dtype=torch.float64, device="cpu", seed=0)


def test_the_run_leaves_the_model_as_it_found_it(cpu_model):
    before = cpu_model.config._attn_implementation
    with streambp_core.prepare(cpu_model, "plain", sequence_group=SequenceGroup.simulated(2)):
        assert cpu_model.config._attn_implementation == "streambp_sequence"
        assert all(hasattr(layer.self_attn, GROUP_ATTRIBUTE) for layer in cpu_model.model.layers)
    assert cpu_model.config._attn_implementation == before
    assert not any(hasattr(layer.self_attn, GROUP_ATTRIBUTE) for layer in cpu_model.model.layers)


@pytest.mark.parametrize(("method", "options", "words"), [
    ("streambp", {"offload": "params"}, "params offload tier"),
    ("plain", {"objective": "grpo", "baseline_loss": "trl"}, "baseline_loss trl"),
])
def test_what_sequence_parallelism_does_not_run_is_refused_by_name(cpu_model, method, options, words):
    with pytest.raises(ConfigError, match=words):
        streambp_core.prepare(cpu_model, method, sequence_group=SequenceGroup.simulated(2), **options)
    streambp_core.prepare(cpu_model, method).close()  # the refused run released the model


def test_the_router_load_balancing_loss_is_refused_by_name():
    config = load_config("tiny/mixtral")
    config.output_router_logits = True
    model = build_model(config, dtype=torch.float64, device="meta", seed=0)
    with pytest.raises(ConfigError, match="router load-balancing loss"):
        streambp_core.prepare(model, "streambp", sequence_group=SequenceGroup.simulated(2))


def test_packed_rows_a_sequence_shorter_than_the_ranks_and_hidden_states_are_refused(cpu_model):
    with streambp_core.prepare(cpu_model, "streambp", sequence_group=SequenceGroup.simulated(4)) as run:
        ids = torch.zeros(1, 8, dtype=torch.long)
        with pytest.raises(ConfigError, match="packed rows"):
            run.loss(ids, position_ids=torch.tensor([[0, 1, 2, 3, 0, 1, 2, 3]]))
        with pytest.raises(ConfigError, match="less than the 4 sequence-parallel ranks"):
            run.loss(ids[:, :3])
        with pytest.raises(ConfigError, match="hidden_states under sequence parallelism"):
            run.hidden_states(ids)


def test_a_step_spec_names_its_sequence_ranks():
    spec = StepSpec.of(model="tiny/llama", method="streambp", gpus=8, sp=8, shard="zero3")
    assert spec.sp == 8 and spec.to_dict()["sp"] == 8
    with pytest.raises(ConfigError, match="--sp 3 does not divide --gpus 8"):
        StepSpec.of(model="tiny/llama", method="streambp", gpus=8, sp=3, shard="zero3")
    with pytest.raises(ConfigError, match="less than the 8 sequence-parallel"):
        StepSpec.of(model="tiny/llama", method="streambp", gpus=8, sp=8, shard="zero3", seq_len_tokens=4)


@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_a_simulated_group_on_real_tensors_is_refused_by_name(cpu_model, method):
    """A simulated group's all-to-alls move nothing: on CPU tensors attention would read the unfilled
    receive buffers (a NaN loss), so the step is refused by name instead."""
    with streambp_core.prepare(cpu_model, method, sequence_group=SequenceGroup.simulated(2)) as run:
        with pytest.raises(ConfigError, match="simulated sequence group runs on meta tensors only"):
            run.loss(torch.zeros(1, 16, dtype=torch.long))
