"""Sequence parallelism (Ulysses) over each kind of family's attention: on two real ranks (gloo), every
method's gradients, summed over the ranks, equal single-process plain's over the whole sequence in float64
with several chunks per layer, for one tiny family of each kind: dense (Llama), routed (Qwen3-MoE),
soft-capped scores (Gemma 2), attention sinks (gpt-oss), chunked local attention with a NoPE query
temperature (Llama 4) and multi-head latent attention with a value head dim below and above the query/key
one (DeepSeek-V3); a rank whose shard runs out of lockstep chunks first runs its empty trailing chunk (in
each family's own layer ops); a simulated rank of each runs; Gated DeltaNet (Qwen3.5) is refused by name."""

from __future__ import annotations

import json

import pytest
import torch

import streambp_core
from streambp_core.config import METHODS, PRESET_DIR, ConfigError, StepSpec
from streambp_core.engine.sequence.attention import lockstep_chunks
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
    pytest.param("mla", "right", id="latent"),
    pytest.param("mla-wide", "left", id="latent-wide-values"),
]


VARIANTS = {
    "mla": ("tiny--deepseek-v3.json", {"v_head_dim": 8}),
    "mla-wide": ("tiny--deepseek-v3.json", {"v_head_dim": 24}),
    "llama4-mqa": ("tiny--llama4.json", {"num_key_value_heads": 1}),
}
"""Presets changed in one field: tiny/deepseek-v3 with value heads narrower than its query/key heads (8
against 8 + 8, as DeepSeek-V3's 128 against 192) or wider (24), and tiny/llama4 with one KV head (two ranks
replicate it). The transformers-driven methods gather keys and values side by side at their own widths."""


def _model(name: str, directory) -> str:
    """`name`, or a directory holding the config of a `VARIANTS` name."""
    if name not in VARIANTS:
        return name
    preset, fields = VARIANTS[name]
    directory.mkdir(exist_ok=True)
    config = json.loads((PRESET_DIR / preset).read_text()) | fields
    (directory / "config.json").write_text(json.dumps(config))
    return str(directory)


def _baseline(name: str) -> dict[str, str]:
    """The single-process reference of a latent-attention variant attends through transformers' own
    attention (`baseline_attention` model), not the engine kernel the methods under test share."""
    return {"baseline_attention": "model"} if name.startswith("mla") else {}


def _verify(model: str, padding: str, methods: tuple[str, ...], **step):
    from streambp_core.verify.sequence import verify_sequence

    spec = VerifySpec.of(model=model, methods=methods, seq_len_tokens=SEQ_LEN, batch_size=2, partition_size=8,
                         head_partition_size=8, dtype="float64", padding=padding, **step)
    return verify_sequence((spec,), nproc=2, sp=2).results


def _inexact(results) -> list[tuple]:
    """(method, error, worst parameter, loss error) of every result not within 1e-12 of single-process
    plain."""
    return [(r.method, r.max_rel_err, r.worst_param, r.loss_abs_err) for r in results
            if not (r.ok and r.max_rel_err <= 1e-12 and r.loss_abs_err <= 1e-12)]


def _assert_exact(results, methods: tuple[str, ...]) -> None:
    assert [r.method for r in results] == list(methods)
    assert not _inexact(results)
    assert all(r.chunks == 3 for r in results)  # the 19-token shard in chunks of 8


@two_ranks
@pytest.mark.slow
def test_llama4_under_two_ranks_matches_single_process_plain() -> None:
    """The cheap cell: Llama 4 with left padding (each row's local chunks start at its first real token),
    through transformers' forward (plain) and streambp's own layers."""
    methods = ("plain", "streambp")
    _assert_exact(_verify("tiny/llama4", "left", methods), methods)


@pytest.mark.slow
@two_ranks
@pytest.mark.parametrize(("model", "padding"), FAMILIES)
def test_every_method_of_each_kind_matches_single_process_plain(model, padding, tmp_path) -> None:
    _assert_exact(_verify(_model(model, tmp_path), padding, METHODS, **_baseline(model)), METHODS)


EMPTY_TRAILING = [  # (model, seq_len_tokens, partition size): rank 1's last lockstep chunk is empty
    pytest.param("tiny/llama4", 37, 6, id="llama4-T37-ps6"),  # shards 19, 18: rank 1 runs 6, 6, 6, 0
    pytest.param("llama4-mqa", 37, 2, id="llama4-mqa-T37-ps2"),  # rank 1's tenth chunk empty
    pytest.param("llama4-mqa", 3, 1, id="llama4-mqa-T3-ps1"),  # shards 2, 1: rank 1 runs 1, 0
    pytest.param("tiny/deepseek-v3", 37, 6, id="deepseek-v3-T37-ps6"),
    pytest.param("mla-wide", 37, 6, id="deepseek-v3-wide-values-T37-ps6"),
]


@pytest.mark.parametrize(("model", "seq_len", "partition"), [EMPTY_TRAILING[i] for i in (0, 2, 3)])
def test_a_rank_runs_its_empty_trailing_chunk_through_each_familys_layer_ops(model, seq_len, partition,
                                                                          tmp_path) -> None:
    """Every rank runs as many chunks (each chunk's all-to-alls), so the rank with the shorter shard runs
    a chunk of zero tokens through its layer's ops (Llama 4's complex RoPE, DeepSeek-V3's latent queries):
    rank 1 of a simulated group of 2 on the meta device, forward and backward."""
    group = SequenceGroup(size=2, rank=1)
    assert lockstep_chunks(group, seq_len, partition)[-1].sizes[1] == 0
    built = build_model(load_config(_model(model, tmp_path)), dtype=torch.bfloat16, device="meta", seed=0)
    ids = torch.zeros(1, seq_len, dtype=torch.long, device="meta")
    with streambp_core.prepare(built, "streambp", partition_size=partition, head_partition_size=partition,
                               sequence_group=group) as run:
        run.loss(ids).backward()
    assert all(param.grad is not None for param in built.parameters() if param.requires_grad)


def _trailing_spec(model: str, seq_len: int, partition: int, methods: tuple[str, ...], directory):
    return VerifySpec.of(model=_model(model, directory), methods=methods, seq_len_tokens=seq_len,
                         partition_size=partition, head_partition_size=partition, dtype="float64",
                         **_baseline(model))


@two_ranks
def test_an_empty_trailing_chunk_and_wider_values_match_single_process_plain(tmp_path) -> None:
    """The cheap cells, in one launch of two ranks: streambp with rank 1's last chunk empty (Llama 4's
    complex RoPE, with its one KV head replicated; DeepSeek-V3's latent queries), and plain with value heads
    wider than the query/key heads (the transformers-driven methods' gathered keys and values)."""
    from streambp_core.verify.sequence import verify_sequence

    specs = (_trailing_spec("llama4-mqa", 3, 1, ("streambp",), tmp_path / "l"),
             _trailing_spec("tiny/deepseek-v3", 37, 6, ("streambp",), tmp_path),
             _trailing_spec("mla-wide", 37, 6, ("plain",), tmp_path / "m"))
    results = verify_sequence(specs, nproc=2, sp=2).results
    assert [(r.method, r.chunks) for r in results] == [("streambp", 2), ("streambp", 4), ("plain", 4)]
    assert not _inexact(results)


@pytest.mark.slow
@two_ranks
@pytest.mark.parametrize(("model", "seq_len", "partition"), EMPTY_TRAILING)
def test_every_method_with_an_empty_trailing_chunk_matches_single_process_plain(model, seq_len, partition,
                                                                             tmp_path) -> None:
    from streambp_core.verify.sequence import verify_sequence

    spec = _trailing_spec(model, seq_len, partition, METHODS, tmp_path)
    results = verify_sequence((spec,), nproc=2, sp=2).results
    assert [r.method for r in results] == list(METHODS)
    assert not _inexact(results)



@pytest.mark.parametrize("model", ["tiny/gemma2", "tiny/gpt-oss", "tiny/llama4", "mla"])
@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_a_simulated_rank_runs(model, method, tmp_path) -> None:
    from streambp_core.step.simulation.simulate import simulate

    result = simulate(StepSpec.of(model=_model(model, tmp_path), method=method, seq_len_tokens=128,
                                  partition_size=32, head_partition_size=16, dtype="bfloat16", gpus=2, sp=2))
    assert result.peak_bytes > 0


@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_gated_deltanet_is_refused_by_name(method) -> None:
    """Its recurrent state runs along the whole sequence: a shard would need the state of every token
    before it."""
    model = build_model("tiny/qwen3.5", dtype=torch.float64, device="meta", seed=0)
    reason = "Gated DeltaNet linear attention .*recurrent state runs along the whole sequence"
    with pytest.raises(ConfigError, match=f"sequence parallelism does not run with {reason}"):
        streambp_core.prepare(model, method, sequence_group=SequenceGroup.simulated(2))
    streambp_core.prepare(model, method).close()  # the refused run released the model


def test_the_transformers_driven_methods_take_over_the_query_temperature_while_open() -> None:
    """transformers would scale a shard's queries from index 0: the sequence-parallel attention applies the
    temperature at the global indices instead, and the module's own is back on when the run closes."""
    model = build_model("tiny/llama4", dtype=torch.float64, device="meta", seed=0)
    nope = [layer.self_attn for layer in model.model.layers if not layer.self_attn.use_rope]
    assert nope and all(attn.attn_temperature_tuning for attn in nope)
    with streambp_core.prepare(model, "checkpoint", sequence_group=SequenceGroup.simulated(2)):
        assert not any(attn.attn_temperature_tuning for attn in nope)
    assert all(attn.attn_temperature_tuning for attn in nope)
