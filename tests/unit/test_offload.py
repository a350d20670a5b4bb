"""Checkpoints in host memory: gradients bitwise equal to the same method without offload, bytes really
moved (counted by the tracker's host pool), plain refused, and the host chain's prefetch bookkeeping."""

from __future__ import annotations

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError, StreamConfig
from streambp_core.engine.host.checkpoints import HostChain, _missing
from streambp_core.measure import MemoryTracker, memory_category
from streambp_core.measure.tags import OFFLOADED
from streambp_core.methods.checkpoint import activation_checkpointing, enable_activation_checkpointing
from streambp_core.models.load import build_model, tiny_config
from streambp_core.step.parts.batch import objective_inputs, random_batch
from streambp_core.verify.methods import verify_methods

F64 = 8  # bytes per float64 element


def offload_step(model, method: str, objective: str, offload: str, batch, **inputs):
    """Loss, every gradient and the tracker's result of one prepared step."""
    model.zero_grad(set_to_none=True)
    options = dict(objective=objective, partition_size=4, head_partition_size=3, offload=offload)
    run = streambp_core.prepare(model, method, **options)
    with run, MemoryTracker(model, device="cpu") as tracker:
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, **inputs)
        loss.backward()
    grads = {n: p.grad.detach().clone() for n, p in model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, tracker.result()


@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("method", ["checkpoint", "mst", "streambp"])
def test_offload_is_bitwise_exact_and_moves_every_checkpoint(method, objective):
    model = build_model(tiny_config("qwen3"), dtype=torch.float64, seed=0)
    vocab = model.config.vocab_size
    batch = random_batch(vocab_size=vocab, seq_len=19, batch_size=2, padding="right", seed=3)
    labels, extra = objective_inputs(objective, batch, seed=1)
    ref_loss, ref, kept = offload_step(model, method, objective, "none", batch, labels=labels, **extra)
    loss, grads, moved = offload_step(model, method, objective, "checkpoints", batch, labels=labels, **extra)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref.keys() and ref
    for name, grad in grads.items():
        assert torch.equal(grad, ref[name]), name
    # every layer input (and for streambp the head's hidden state) went to the host and came back once
    saved = model.config.num_hidden_layers + (method == "streambp")
    layer_input_bytes = batch.input_ids.numel() * model.config.hidden_size * F64
    assert moved.to_host_bytes == moved.to_device_bytes == saved * layer_input_bytes
    assert moved.host_peak_bytes == saved * layer_input_bytes
    assert moved.host_end_bytes == 0
    assert (kept.host_peak_bytes, kept.to_host_bytes, kept.to_device_bytes) == (0, 0, 0)


def test_plain_refuses_offload_by_name():
    model = build_model(tiny_config("llama"), dtype=torch.float64, seed=0)
    with pytest.raises(ConfigError, match="does not apply to plain.*nothing to offload") as err:
        streambp_core.prepare(model, "plain", offload="checkpoints")
    assert "\n" not in str(err.value)


def test_offload_choice_is_validated():
    with pytest.raises(ConfigError, match="offload must be one of none, checkpoints"):
        StreamConfig(offload="both")


def test_close_restores_a_checkpointing_models_own_function():
    model = build_model(tiny_config("qwen3"), dtype=torch.float64, seed=0)
    enable_activation_checkpointing(model)
    layer = model.model.layers[0]
    before = layer._gradient_checkpointing_func
    with streambp_core.prepare(model, "checkpoint", offload="checkpoints"):
        assert layer._gradient_checkpointing_func is not before
    assert layer._gradient_checkpointing_func is before
    assert activation_checkpointing(model)


@pytest.mark.slow
def test_streambp_offload_keeps_one_layer_input_on_the_device():
    """At the device peak: without offload every layer input is kept; with it one (the chain's buffer),
    while the host holds every layer input and the head's hidden state."""
    config, device = tiny_config("qwen3", num_hidden_layers=6), "meta"
    model = build_model(config, dtype=torch.float64, device=device, seed=0)
    for param in model.parameters():
        param.grad = torch.zeros_like(param)  # resident, so the peak falls in the layers' backward
    ids = torch.zeros(1, 512, dtype=torch.long, device=device)
    results = {}
    for offload in ("none", "checkpoints"):
        with streambp_core.prepare(model, "streambp", partition_size=64, offload=offload) as run:
            with MemoryTracker(model, device=device) as tracker:
                run.loss(ids).backward()
        results[offload] = tracker.result()
    layer_input = 512 * config.hidden_size * F64
    kept, offloaded = results["none"], results["checkpoints"]
    assert kept.peak_breakdown_bytes["checkpoints"] == config.num_hidden_layers * layer_input
    assert offloaded.peak_breakdown_bytes["checkpoints"] == layer_input
    assert kept.peak_bytes - offloaded.peak_bytes == (config.num_hidden_layers - 1) * layer_input
    assert offloaded.host_peak_bytes == (config.num_hidden_layers + 1) * layer_input


def test_host_chain_prefetches_chunk_by_chunk_and_fills_the_rest_on_load():
    chain = HostChain("cpu")
    first, second = torch.arange(12.0).view(1, 6, 2), -torch.arange(12.0).view(1, 6, 2)
    slots = [chain.save(first), chain.save(second)]
    buffer = slots[1].load()
    assert torch.equal(buffer, second)
    slots[1].chunk_done(4, 6)  # only the last chunk reported: slot 0's 4..6 arrives now
    assert torch.equal(buffer[:, 4:6], first[:, 4:6]) and torch.equal(buffer[:, :4], second[:, :4])
    assert slots[0].load() is buffer and torch.equal(buffer, first)
    with pytest.raises(RuntimeError, match="loaded twice"):
        slots[0].load()


def test_missing_ranges():
    assert _missing([], 5) == [(0, 5)]
    assert _missing([(3, 5), (0, 1)], 5) == [(1, 3)]
    assert _missing([(0, 2), (2, 5)], 5) == []


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_tracker_host_pool_has_its_own_peak_and_counts_copies_each_way(device):
    with MemoryTracker(device=device) as tracker:
        layer_input = torch.empty(1000, device=device)  # 4000 bytes on the device
        with memory_category(OFFLOADED):
            host = torch.empty(1000, device=device)
        host.copy_(layer_input)
        del layer_input
        back = torch.empty(250, device=device)
        back.copy_(host[:250])  # 1000 bytes back
        moved = torch.empty(10, device=device)
        tracker.retag(moved, OFFLOADED)  # a device storage moved to the host pool
        assert tracker.host_live_bytes == 4040
        del host
    result = tracker.result()
    assert (result.peak_bytes, result.host_peak_bytes, result.host_end_bytes) == (4000, 4040, 40)
    assert (result.to_host_bytes, result.to_device_bytes) == (4000, 1000)
    assert "offloaded" not in result.peak_breakdown_bytes
    assert sum(result.end_breakdown_bytes.values()) == result.end_bytes == 1000
    del back, moved


def test_verify_runs_every_method_offloaded_against_plain():
    report = verify_methods("tiny/llama", seq_len=24, partition_size=5, head_partition_size=4,
                            dtype="float64", offload="checkpoints")
    assert str(report.spec.step.stream.offload) == "checkpoints"
    assert [r.method for r in report.results] == ["checkpoint", "mst", "streambp"]
    assert all(r.ok and r.max_rel_err <= 1e-12 for r in report.results)
    with pytest.raises(ConfigError, match="does not apply to plain"):
        verify_methods("tiny/llama", methods=("plain",), offload="checkpoints")


def test_simulated_host_pool_extrapolates_exactly_and_plain_spec_refuses_offload():
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    config = tiny_config("qwen3", num_hidden_layers=5)
    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=512, partition_size=64,
                       head_partition_size=64, offload="checkpoints")
    extrapolated, full = simulate(spec, config), simulate(spec, config, depth="full")
    layer_input = 512 * config.hidden_size * 2  # bfloat16
    assert extrapolated.layers_simulated == (2, 3) and full.full_depth
    for result in (extrapolated, full):
        assert result.host_peak_bytes == result.to_host_bytes == result.to_device_bytes == 6 * layer_input
    assert extrapolated.peak_bytes == full.peak_bytes
    with pytest.raises(ConfigError, match="does not apply to plain"):
        StepSpec.of(model="tiny/qwen3", method="plain", offload="checkpoints")


@pytest.mark.parametrize("shard", ["zero2", "zero3"])
def test_params_tier_under_fsdp2_is_refused_by_name_not_laid_out_below_zero(shard):
    """The FSDP2 layout takes the simulated step's weights as the whole model's; with the params tier they
    are one gathered unit, and the rank's weights came out negative. DeepSpeed ZeRO-3 lays it out."""
    from streambp_core.config import StepSpec
    from streambp_core.step.simulation.simulate import simulate

    fields = dict(model="tiny/qwen3", method="streambp", seq_len_tokens=128, partition_size=32,
                  head_partition_size=32, gpus=2, offload="params")
    with pytest.raises(ConfigError, match=f"offload params with {shard} is not simulated"):
        simulate(StepSpec.of(shard=shard, **fields))
    result = simulate(StepSpec.of(shard="deepspeed-zero3", **fields))
    assert min(result.breakdown_bytes.values()) >= 0 and result.peak_bytes > 0
