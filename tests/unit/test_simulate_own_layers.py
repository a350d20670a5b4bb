"""streambp through a family's own decoder layers (`engine.own`) simulates: under the engine's attention
(baseline_attention "engine", "auto" on meta) transformers builds no mask, so nothing reads a meta tensor's
value; the path stays exact there in float64; its simulated peak is the same step's peak on CPU tensors and
holds what the path keeps (every layer's input, one layer's whole-sequence K/V and their gradients); and
`max-len` answers for such a family."""

from __future__ import annotations

import json

import pytest
import torch

import streambp_core
from streambp_bench.cli import app
from streambp_core.config import ConfigError, StepSpec
from streambp_core.models import load_config
from streambp_core.models.load import build_model
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search.probe import measure_setup
from streambp_core.step.simulation.simulate import simulate
from tests.unit.test_exactness import assert_matches_plain, batch
from tests.unit.test_streambp_own_layers import SEQ_LEN, config_dir


@pytest.mark.parametrize("family", ["ministral3", "minimax_m2", "cohere2"])
def test_streambp_under_the_engine_attention_matches_plain(tmp_path, family):
    """Windows of 8 (ministral3, cohere2) and left padding: the (B, 1, 1, T) key mask is cut per chunk."""
    torch.manual_seed(0)
    model = build_model(config_dir(tmp_path, family), dtype=torch.float64, seed=0)
    ids, mask = batch(model.config.vocab_size, 2, SEQ_LEN, "left")
    assert_matches_plain(model, ids, mask, methods=("streambp",), partition_size=8, head_partition_size=8,
                         baseline_attention="engine")


def test_simulated_peak_is_the_cpu_step_and_holds_what_the_path_keeps(tmp_path):
    """Same step (2 layers, T 100, float32, ps 32) on meta and on CPU tensors, both under the engine's
    attention (a StepSpec's "auto"). Tolerance, with its reason: the simulation charges the GPU attention
    kernel's workspace (124 KiB here, `kernel_workspace`), which the exact CPU kernel does not hold, while the
    CPU kernel's own temporaries are larger (88 KiB): 2.4% apart. At the peak, in the last layer's
    backward: both layers' inputs (B, T, d) and that layer's K, V and their gradients (B, Hkv, T, hd)."""
    directory = config_dir(tmp_path, "ministral3")
    seq_len, itemsize = 100, 4
    spec = StepSpec.of(model=directory, method="streambp", seq_len_tokens=seq_len, dtype="float32",
                       partition_size=32, head_partition_size=16)
    config = load_config(directory)
    simulated = simulate(spec, config, depth="full")
    measured = measure_setup(build_setup(spec, config, "cpu"), "cpu")
    assert measured.status == "ok" and measured.source == "measured-cpu"
    assert abs(measured.peak_bytes - simulated.peak_bytes) <= 0.03 * measured.peak_bytes
    assert sum(simulated.breakdown_bytes.values()) == simulated.peak_bytes
    layer_input = seq_len * config.hidden_size * itemsize
    kv = seq_len * config.num_key_value_heads * config.head_dim * itemsize
    assert simulated.breakdown_bytes["checkpoints"] == config.num_hidden_layers * layer_input
    assert simulated.breakdown_bytes["kv"] == 4 * kv


def test_the_models_own_attention_is_refused_on_meta_by_name(tmp_path):
    with torch.device("meta"):
        model = build_model(config_dir(tmp_path, "ministral3"), dtype=torch.float32, device="meta")
    with pytest.raises(ConfigError, match="its own decoder layers, which do not carry the meta device of a "
                                          "simulation under the model's own attention"):
        streambp_core.prepare(model, "streambp", baseline_attention="model")


def test_max_len_answers_for_a_family_streamed_through_its_own_layers(tmp_path, runner):
    directory = config_dir(tmp_path, "ministral3")
    args = ["max-len", "-m", directory, "--method", "streambp", "--ps", "32", "--ps-head", "16",
            "--budget-gib", "0.002", "--device", "sim", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    (entry,) = json.loads(result.stdout)["results"]
    assert entry["method"] == "streambp" and entry["max_len_tokens"] > 0
    assert 0 < entry["peak_gib"] <= 0.002
