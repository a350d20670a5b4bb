"""DeepSeek-V4 (compressed sparse attention) through its own decoder layers (`engine.own.compressed`): every
method's gradients equal plain's in float64 for every parameter (batch 2, left and right padding, T = 37,
partitions of 6 that cut the 4-token CSA blocks and the 16-token HCA blocks), the indexer's weights get
none; the state carried across chunk boundaries and the indexer's pick shape the gradients; a float64 V4's
float32 pieces are widened (`models.precision_v4`); mst cuts the `input_ids` its hash-routed MoE takes;
every method simulates on the meta device."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError, StepSpec
from streambp_core.engine.chunks import leaf
from streambp_core.engine.own import compressed
from streambp_core.engine.stream.mlp import chunk_mlp, unchunk_mlp
from streambp_core.models.load import build_model, load_config
from streambp_core.step.simulation.simulate import simulate
from tests.unit.test_exactness import batch, relative_errors, step
from tests.unit.test_streambp_own_layers import config_dir
from tests.unit.test_streambp_sparse_attention_own_layers import dsa_dir

SEQ_LEN = 37
"""Tokens per row: not a multiple of the partition, nor of either block."""
PARTITION = 6
"""Query tokens per chunk: chunk boundaries fall inside CSA blocks (4) and HCA blocks (16)."""


def v4_dir(tmp_path, **overrides) -> str:
    """A tiny DeepSeek-V4: a sliding layer (window 8), a compressed sparse (4:1, the indexer keeping 4
    entries) and a heavily compressed (16:1) one; a hash-routed MoE, then two routed ones."""
    values = {"num_hidden_layers": 3, "sliding_window": 8, "index_n_heads": 4, "index_head_dim": 16,
              "index_topk": 4, "o_groups": 2, "o_lora_rank": 16,
              "layer_types": ["sliding_attention", "compressed_sparse_attention",
                              "heavily_compressed_attention"],
              "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 16},
              "mlp_layer_types": ["hash_moe", "moe", "moe"]}
    return config_dir(tmp_path, "deepseek_v4", **values | overrides)


def errors_against_plain(model, method: str, padding: str = "right", **options) -> tuple[float, dict]:
    """The loss's relative error against plain's and each parameter's gradient's; the parameters a
    gradient reaches must be plain's."""
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, padding)
    plain_loss, plain = step(model, "plain", ids, mask)
    loss, grads = step(model, method, ids, mask, **options)
    assert grads.keys() == plain.keys()
    return float(abs(loss - plain_loss) / abs(plain_loss)), relative_errors(grads, plain)


@pytest.mark.parametrize("method", ["checkpoint", "mst", "streambp"])
@pytest.mark.parametrize("padding", ["right", "left"])
def test_every_method_through_deepseek_v4_matches_plain(tmp_path, method, padding):
    model = build_model(v4_dir(tmp_path), dtype=torch.float64, seed=0)
    loss_error, errors = errors_against_plain(model, method, padding, partition_size=PARTITION,
                                              head_partition_size=8)
    assert loss_error <= 1e-12
    assert max(errors.values()) <= 1e-12, max(errors.items(), key=lambda item: item[1])
    assert not any(".indexer." in name for name in errors)  # no gradient, as in plain


def test_the_compressor_state_carried_across_chunks_matters(tmp_path, monkeypatch):
    """streambp with the carried buffer and overlap zeroed (each chunk's windows that straddle its start
    closed from zeros) puts the compressors' weights more than 1e-3 (relative) from plain's."""
    model = build_model(v4_dir(tmp_path), dtype=torch.float64, seed=0)

    def zeroed(state):
        tensors = (state.buffer_kv, state.buffer_gate, state.overlap_kv, state.overlap_gate)
        return compressed.Carried(*(None if t is None else leaf(torch.zeros_like(t)) for t in tensors),
                                  count=state.count)

    monkeypatch.setattr(compressed.Carried, "leaves", zeroed)
    _, errors = errors_against_plain(model, "streambp", partition_size=PARTITION, head_partition_size=8)
    for layer in (1, 2):  # CSA, HCA
        assert errors[f"model.layers.{layer}.self_attn.compressor.kv_proj.weight"] > 1e-3


def test_the_indexer_pick_and_the_compressed_entries_shape_the_loss(tmp_path):
    """The tests' configs are not vacuous: keeping every CSA entry, or compressing no HCA block, changes the
    loss."""
    ids, mask = batch(512, 2, SEQ_LEN, "right")
    losses = []
    for name, overrides in {"v4": {}, "every entry": {"index_topk": SEQ_LEN},
                            "no HCA block": {"compress_rates": {"compressed_sparse_attention": 4,
                                                                "heavily_compressed_attention": 64}}}.items():
        model = build_model(v4_dir(tmp_path / name, **overrides), dtype=torch.float64, seed=0)
        losses.append(float(step(model, "plain", ids, mask)[0]))
    assert abs(losses[0] - losses[1]) > 1e-6 and abs(losses[0] - losses[2]) > 1e-6


def test_a_float64_v4_computes_its_float32_pieces_in_float64(tmp_path):
    """`build_model` widens the hyper-connections, norms, sinks, position biases and rotary tables; a user's
    own float64 V4 (transformers keeps them float32) is refused by streambp, naming them, and `.double()`
    brings it to 1e-12."""
    from transformers import AutoConfig, AutoModelForCausalLM

    built = build_model(v4_dir(tmp_path), dtype=torch.float64, seed=0)
    floating = [t for t in (*built.parameters(), *built.buffers()) if t.is_floating_point()]
    assert {t.dtype for t in floating} == {torch.float64}
    torch.manual_seed(0)
    config = AutoConfig.from_pretrained(v4_dir(tmp_path))
    own = AutoModelForCausalLM.from_config(config, dtype=torch.float64, experts_implementation="eager")
    assert own.model.layers[0].attn_hc.fn.dtype == torch.float32
    options = {"partition_size": PARTITION, "head_partition_size": 8}
    with pytest.raises(ConfigError, match=r"the float32 pieces DeepSeek-V4 keeps in a float64 model \(43 "
                                          r"parameters: model.layers.0.self_attn.sinks, \.\.\.\)"):
        streambp_core.prepare(own, "streambp", **options)
    own.double()
    assert max(errors_against_plain(own, "streambp", **options)[1].values()) <= 1e-12


def test_mst_refuses_an_mlp_input_it_cannot_cut():
    """A keyword input of the MLP that is no (B, T) tensor without gradient is refused by name."""
    mlp = torch.nn.Linear(4, 4)
    chunk_mlp(mlp, 2)
    x = torch.randn(1, 6, 4, requires_grad=True)
    try:
        with pytest.raises(ConfigError, match="mst: the MLP's argument 'input_ids' is not a per-token input"):
            mlp(x, input_ids=torch.zeros(1, 5, dtype=torch.long))
    finally:
        unchunk_mlp(mlp)


def test_verify_runs_every_method_on_deepseek_v4(tmp_path):
    """No method is refused for the family before a step (what `verify --method all` leaves out)."""
    from streambp_core.methods.guards import family_refusals

    assert family_refusals(load_config(v4_dir(tmp_path))) == {}


@pytest.mark.parametrize("method", ["plain", "checkpoint", "mst", "streambp"])
def test_every_method_simulates_on_the_meta_device(tmp_path, method):
    """streambp too keeps the model's own attention there (the engine kernel takes no compressed blocks),
    given plain's all-ones mask."""
    result = simulate(StepSpec.of(model=v4_dir(tmp_path), method=method, seq_len_tokens=64))
    assert result.peak_bytes > 0


def test_streambp_simulates_a_dsa_family_on_the_meta_device(tmp_path):
    spec = StepSpec.of(model=dsa_dir(tmp_path, "glm_moe_dsa"), method="streambp", seq_len_tokens=64)
    assert simulate(spec).peak_bytes > 0


@pytest.mark.parametrize("attention", ["model", "engine"])
def test_deepseek_v4_plain_is_its_own_forward(tmp_path, attention):
    """plain's loss is the model's own forward's: its eager attention (gpt-oss's form, sinks, softmax in the
    scores' precision) is not swapped for the widened eager, which has no sinks (1.1e-3 apart), and its
    compressed blocks are not handed to the engine kernel, which does not take them."""
    model = build_model(v4_dir(tmp_path), dtype=torch.float64, seed=0)
    ids = batch(model.config.vocab_size, 2, SEQ_LEN, "right")[0]
    with torch.no_grad():
        logits = model(ids).logits[:, :-1].flatten(0, 1)
        expected = torch.nn.functional.cross_entropy(logits, ids[:, 1:].flatten()).item()
        with streambp_core.prepare(model, "plain", baseline_attention=attention) as run:
            loss = run.loss(ids).item()
    assert abs(loss - expected) <= 1e-12 * abs(expected)
