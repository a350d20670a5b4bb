"""Tracked memory of a real CPU step where the logits dominate: the methods' ordering, and the logits
and checkpoint bytes computed by hand."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import StepSpec
from streambp_core.models.load import build_model, tiny_config
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search.probe import measure_setup


def measure_step(model, spec: StepSpec, seq_len: int):
    """The tracked peak of one CPU step of `spec` at `seq_len` on `model`."""
    return measure_setup(build_setup(spec.at(seq_len), model.config, "cpu", model=model), "cpu")

SEQ_LEN, VOCAB, LAYERS, HEAD_CHUNK = 256, 8192, 2, 32
F32 = 4


@pytest.fixture(scope="module")
def peaks():
    config = tiny_config("qwen3", vocab_size=VOCAB, num_hidden_layers=LAYERS)
    model = build_model(config, dtype=torch.float32)
    results = {}
    for method in ("plain", "checkpoint", "mst", "streambp"):
        spec = StepSpec.of(model="tiny/qwen3", method=method, dtype="float32", partition_size=64,
                           head_partition_size=HEAD_CHUNK)
        results[method] = measure_step(model, spec, SEQ_LEN)
    return results, config.hidden_size


def test_ordering(peaks):
    results, _ = peaks
    order = [results[m].peak_bytes for m in ("streambp", "mst", "checkpoint", "plain")]
    assert order == sorted(order) and len(set(order)) == 4, order


def test_full_logits_versus_one_chunk(peaks):
    results, _ = peaks
    full = SEQ_LEN * VOCAB * F32  # one float32 (T, V) tensor
    for method in ("plain", "checkpoint"):  # logits, their log-softmax and its gradient, all (T, V)
        assert results[method].breakdown_bytes["logits"] == 3 * full
    chunk = HEAD_CHUNK * VOCAB * F32
    for method in ("mst", "streambp"):  # never more than a few (chunk, V) tensors
        assert results[method].breakdown_bytes["logits"] <= 4 * chunk + 1024
        assert results["plain"].peak_bytes - results[method].peak_bytes >= 2 * full


def test_checkpoints_are_the_layer_inputs(peaks):
    results, hidden = peaks
    per_layer_input = SEQ_LEN * hidden * F32
    for method in ("checkpoint", "mst", "streambp"):  # embedding output + each layer's output
        assert results[method].breakdown_bytes["checkpoints"] == (LAYERS + 1) * per_layer_input


@pytest.mark.slow
def test_streambp_backward_keeps_one_layer_gradient(monkeypatch):
    """Writing dL/dH_in over dL/dH_out (LayerPlan.reuse_grad_out) lowers a layer-bound peak by exactly one
    (B, T, d) gradient, and changes no gradient."""
    from streambp_core.engine.stream.layer import LayerPlan
    from streambp_core.methods import streambp

    config = tiny_config("llama", vocab_size=96, num_hidden_layers=3)  # vocab != any hidden width
    model = build_model(config, dtype=torch.float32)
    spec = StepSpec.of(model="tiny/llama", method="streambp", dtype="float32", partition_size=256,
                       head_partition_size=64)
    seq_len = 4096
    results, grads = {}, {}
    for reuse in (True, False):
        monkeypatch.setattr(streambp, "LayerPlan",
                            lambda *a, reuse=reuse, **k: LayerPlan(*a, **{**k, "reuse_grad_out": reuse}))
        results[reuse] = measure_step(model, spec, seq_len)
        with streambp_core.prepare(model, "streambp", partition_size=256, head_partition_size=64) as run:
            model.zero_grad(set_to_none=True)
            run.loss(torch.arange(seq_len)[None] % 96).backward()
        grads[reuse] = [p.grad.clone() for p in model.parameters()]
    saved = results[False].peak_bytes - results[True].peak_bytes
    assert saved == seq_len * config.hidden_size * F32
    assert all(torch.equal(a, b) for a, b in zip(grads[True], grads[False], strict=True))
