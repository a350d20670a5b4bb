"""Sequence parallelism (Ulysses) over each kind of family's attention: on two real ranks (gloo), every
method's gradients, summed over the ranks, equal single-process plain's over the whole sequence in float64
with several chunks per layer, for one tiny family of each kind: dense (Llama), routed (Qwen3-MoE),
soft-capped scores (Gemma 2), attention sinks (gpt-oss) and chunked local attention with a NoPE query
temperature (Llama 4); a simulated rank of each runs; multi-head latent attention (DeepSeek-V3) and Gated
DeltaNet (Qwen3.5) are refused by name."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import METHODS, ConfigError, StepSpec
from streambp_core.engine.sequence.group import SequenceGroup
from streambp_core.models import build_model, load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.verify.methods import VerifySpec

two_ranks = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")

SEQ_LEN = 37
"""Shards of 19 and 18 tokens, chunks of 8: rank 1 starts past Llama 4's first local chunk (16 positions)
and two of its temperature steps (every 8 indices), so a shard counted from its own index 0 would differ."""
assert SEQ_LEN // 2 > load_config("tiny/llama4").attention_chunk_size

FAMILIES = [
    pytest.param("tiny/llama", "right", id="dense"),
    pytest.param("tiny/qwen3-moe", "right", id="moe"),
    pytest.param("tiny/gemma2", "right", id="softcap"),
    pytest.param("tiny/gpt-oss", "left", id="sinks"),
    pytest.param("tiny/llama4", "left", id="chunked-local-and-temperature"),
]


def _verify(model: str, padding: str, methods: tuple[str, ...]):
    from streambp_core.verify.sequence import verify_sequence

    spec = VerifySpec.of(model=model, methods=methods, seq_len_tokens=SEQ_LEN, batch_size=2, partition_size=8,
                         head_partition_size=8, dtype="float64", padding=padding)
    return verify_sequence((spec,), nproc=2, sp=2).results


def _assert_exact(results, methods: tuple[str, ...]) -> None:
    assert [r.method for r in results] == list(methods)
    bad = [(r.method, r.max_rel_err, r.worst_param, r.loss_abs_err) for r in results
           if not (r.ok and r.max_rel_err <= 1e-12 and r.loss_abs_err <= 1e-12)]
    assert not bad
    assert all(r.chunks == 3 for r in results)  # the 19-token shard in chunks of 8


@two_ranks
def test_llama4_under_two_ranks_matches_single_process_plain() -> None:
    """The cheap cell: Llama 4 with left padding (each row's local chunks start at its first real token),
    through transformers' forward (plain) and streambp's own layers."""
    methods = ("plain", "streambp")
    _assert_exact(_verify("tiny/llama4", "left", methods), methods)


@pytest.mark.slow
@two_ranks
@pytest.mark.parametrize(("model", "padding"), FAMILIES)
def test_every_method_of_each_kind_matches_single_process_plain(model, padding) -> None:
    _assert_exact(_verify(model, padding, METHODS), METHODS)


@pytest.mark.parametrize("model", ["tiny/gemma2", "tiny/gpt-oss", "tiny/llama4"])
@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_a_simulated_rank_runs(model, method) -> None:
    from streambp_core.step.simulate import simulate

    result = simulate(StepSpec.of(model=model, method=method, seq_len_tokens=128, partition_size=32,
                                  head_partition_size=16, dtype="bfloat16", gpus=2, sp=2))
    assert result.peak_bytes > 0


@pytest.mark.parametrize(("model", "reason"), [
    ("tiny/deepseek-v3", "multi-head latent attention"),
    ("tiny/qwen3.5", "Gated DeltaNet linear attention .*recurrent state runs along the whole sequence"),
])
@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_what_still_cannot_split_over_the_sequence_is_refused_by_name(model, reason, method) -> None:
    model = build_model(model, dtype=torch.float64, device="meta", seed=0)
    with pytest.raises(ConfigError, match=f"sequence parallelism does not run with {reason}"):
        streambp_core.prepare(model, method, sequence_group=SequenceGroup.simulated(2))
    streambp_core.prepare(model, method).close()  # the refused run released the model
