"""Sequence parallelism (Ulysses) on two real ranks (gloo): every method's gradients, summed over the ranks
sharing the sequence, equal single-process plain's over the whole sequence in float64 (sft everywhere,
grpo and dpo, padding in one rank's shard only, a length that neither the chunk nor the ranks divide, tied
and untied heads, KV heads replicated, checkpoints in host memory); each step's all-to-alls are a
constant per layer plus a constant per lockstep chunk."""

from __future__ import annotations

import json
from dataclasses import replace

import pytest

from streambp_core.config import METHODS, PRESET_DIR
from streambp_core.engine.sequence.attention import KV_PIECES
from streambp_core.models import load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.step.parts.batch import random_batch
from streambp_core.verify.methods import VerifySpec

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")]

SEQ_LEN = 37  # shards of 19 and 18 tokens: neither the chunk (8, 6) nor the ranks divide it
assert SEQ_LEN // 2 >= KV_PIECES  # so every K/V swap runs in all its pieces
LAYERS = load_config("tiny/llama").num_hidden_layers
PER_LAYER = {"plain": 6, "checkpoint": 9, "mst": 9}
"""All-to-alls per layer and step of the transformers-driven methods: K/V, queries and outputs forward and
backward (checkpoint and mst recompute the forward's three)."""


def _mqa_model(directory) -> str:
    """tiny/llama with one KV head (4 query heads): two ranks need it replicated."""
    config = json.loads((PRESET_DIR / "tiny--llama.json").read_text())
    config["num_key_value_heads"] = 1
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


@pytest.fixture(scope="module")
def report(tmp_path_factory):
    from streambp_core.verify.sequence import verify_sequence

    base = VerifySpec.of(model="tiny/llama", methods=METHODS, seq_len_tokens=SEQ_LEN, batch_size=2,
                         partition_size=8, head_partition_size=5, dtype="float64", padding="right")
    qwen = replace(base, step=replace(base.step, model="tiny/qwen3"), padding="left")
    specs = (
        base,
        replace(base, methods=("streambp",), step=base.step.replaced(partition_size=6)),  # rank 1: 6,6,6,0
        replace(qwen, methods=("plain", "streambp"), step=qwen.step.replaced(objective="grpo",
                                                                            head_mode="fused")),
        replace(qwen, methods=("mst", "streambp"), step=qwen.step.replaced(objective="dpo")),
        replace(base, methods=("checkpoint", "streambp"), padding="none",
                step=replace(base.step, model=_mqa_model(tmp_path_factory.mktemp("mqa")))),
        replace(base, methods=("mst", "streambp"), step=base.step.replaced(offload="checkpoints")),
    )
    return specs, verify_sequence(specs, nproc=2, sp=2)


def test_padding_lies_in_one_ranks_shard_only():
    batch = random_batch(vocab_size=512, seq_len=SEQ_LEN, batch_size=2, padding="right", seed=1)
    first = SEQ_LEN - SEQ_LEN // 2
    assert bool(batch.attention_mask[:, :first].all()) and not bool(batch.attention_mask[:, first:].all())


def test_every_method_matches_single_process_plain_over_the_whole_sequence(report):
    specs, result = report
    assert [(r.method, r.objective) for r in result.results] == [
        (m, s.step.objective) for s in specs for m in s.methods]
    bad = [(r.method, r.objective, r.max_rel_err, r.worst_param) for r in result.results if not r.ok]
    assert not bad
    assert all(r.max_rel_err <= 1e-10 and r.loss_abs_err <= 1e-10 for r in result.results)
    assert result.source == "measured-cpu" and (result.nproc, result.sp) == (2, 2)


def test_all_to_alls_are_a_constant_per_layer_plus_a_constant_per_chunk(report):
    _, result = report
    streamed = [r for r in result.results if r.method == "streambp"]
    assert {r.chunks for r in streamed} == {3, 4}  # ps 8 and 6 over the 19-token shard
    for r in streamed:
        expected = r.layers * (3 * KV_PIECES + 6 * r.chunks)  # K/V twice and dK/dV once per layer, in pieces
        assert r.all_to_alls == expected, (r.objective, r.chunks, r.all_to_alls)
    for r in result.results:
        if r.method in PER_LAYER:
            assert r.all_to_alls == PER_LAYER[r.method] * r.layers == PER_LAYER[r.method] * LAYERS
        assert r.all_reduces == (1 if r.method in ("plain", "checkpoint") else 2)  # the sequences' sums
        assert r.all_to_all_bytes > 0
