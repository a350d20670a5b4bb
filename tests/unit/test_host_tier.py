"""The optimizer and params offload tiers: the applied update bitwise equal to the same step without them
(float64 on CPU, where the host masters have the parameters' dtype), weights read only while gathered,
gradients and weights really held and moved by the host pool, and bad tier sets refused. The matrices run a
few cells by default (a tied head, LoRA, each kind of method), every cell under -m slow."""

from __future__ import annotations

import copy

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError, StepSpec
from streambp_core.engine.host import unit_grads
from streambp_core.engine.host.optimizer import HostAdamW
from streambp_core.engine.host.params import HostParams
from streambp_core.measure import MemoryTracker
from streambp_core.measure.tags import OFFLOADED
from streambp_core.methods import host_tier
from streambp_core.models.load import build_model, tiny_config
from streambp_core.models.lora import apply_lora
from streambp_core.step.parts.batch import objective_inputs, random_batch

ALL = "checkpoints,optimizer,params"


def cells(names: str, cases: list[tuple], default: set[tuple]) -> pytest.MarkDecorator:
    """`parametrize(names, cases)` with every case outside `default` slow."""
    return pytest.mark.parametrize(names, [
        pytest.param(*case, marks=() if case in default else pytest.mark.slow) for case in cases])


def _model(family: str = "qwen3", lora: int = 0):
    model = build_model(tiny_config(family), dtype=torch.float64, seed=0)
    return apply_lora(model, lora) if lora else model


def _batch(model, objective: str):
    vocab = model.config.vocab_size
    batch = random_batch(vocab_size=vocab, seq_len=13, batch_size=2, padding="right", seed=3)
    labels, extra = objective_inputs(objective, batch, seed=1)
    return {"input_ids": batch.input_ids, "attention_mask": batch.attention_mask, "labels": labels, **extra}


def _train(model, method: str, objective: str, offload: str, inputs: dict, steps: int = 2):
    """`steps` AdamW steps of `method` at `offload`; the losses and every parameter after them."""
    run = streambp_core.prepare(model, method, objective=objective, partition_size=4,
                                head_partition_size=3, offload=offload)
    losses = []
    with run:
        optimizer = run.adamw(lr=1e-2)
        for _ in range(steps):
            loss = run.loss(**inputs)
            loss.backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            losses.append(loss.detach())
        if "optimizer" in offload:
            assert isinstance(optimizer, HostAdamW)
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


@pytest.mark.slow
@pytest.mark.parametrize("lora", [0, 2])
@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("method", ["checkpoint", "mst", "streambp"])
def test_update_with_every_tier_is_bitwise_the_update_without(method, objective, lora):
    model = _model(lora=lora)
    inputs = _batch(model, objective)
    ref_losses, ref = _train(copy.deepcopy(model), method, objective, "none", inputs)
    losses, params = _train(model, method, objective, ALL, inputs)
    assert all(torch.equal(a, b) for a, b in zip(losses, ref_losses, strict=True))
    changed = [name for name in ref if not torch.equal(ref[name], _model(lora=lora).state_dict()[name])]
    assert changed  # the step did update weights
    for name, value in params.items():
        assert value.device.type == "cpu" and torch.equal(value, ref[name]), name


@cells(("family", "offload"), [(family, offload) for family in ("llama", "qwen2")  # untied; tied head
                                for offload in ("optimizer", "optimizer,params", "checkpoints,params")],
       {("qwen2", "optimizer,params"), ("llama", "checkpoints,params")})
def test_each_tier_combination_is_bitwise(family, offload):
    model = _model(family)
    inputs = _batch(model, "sft")
    steps = 1 if "optimizer" not in offload else 2
    method = "streambp"
    if "optimizer" not in offload:  # no host optimizer: compare gradients of a backprop step
        ref_model = copy.deepcopy(model)
        for target, tiers in ((ref_model, "none"), (model, offload)):
            with streambp_core.prepare(target, method, partition_size=4, head_partition_size=3,
                                       offload=tiers) as run:
                run.loss(**inputs).backward()
        for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
            assert torch.equal(p.grad, q.grad), name
        return
    _, ref = _train(copy.deepcopy(model), method, "sft", "none", inputs, steps)
    _, params = _train(model, method, "sft", offload, inputs, steps)
    for name, value in params.items():
        assert torch.equal(value, ref[name]), name


def test_plain_takes_the_optimizer_tier_bitwise():
    model = _model("llama")
    inputs = _batch(model, "sft")
    _, ref = _train(copy.deepcopy(model), "plain", "sft", "none", inputs)
    _, params = _train(model, "plain", "sft", "optimizer", inputs)
    for name, value in params.items():
        assert torch.equal(value, ref[name]), name


SEND_CASES = [*((method, family, 0, "recompute") for method in ("plain", "checkpoint", "mst", "streambp")
                 for family in ("llama", "qwen2")),  # untied; tied embedding and head
              ("mst", "llama", 2, "recompute"), ("streambp", "llama", 2, "recompute"),
              ("streambp", "qwen2", 0, "fused")]


@cells(("method", "family", "lora", "head_mode"), SEND_CASES, {
    ("checkpoint", "qwen2", 0, "recompute"), ("mst", "llama", 2, "recompute"),
    ("streambp", "qwen2", 0, "recompute"), ("streambp", "qwen2", 0, "fused")})
def test_each_gradient_goes_to_the_host_once_per_backward(method, family, lora, head_mode):
    """mst's MLP tiles and head chunks, streambp's chunks and a tied head add to a gradient several times
    per backward: the host still gets each parameter's gradient once, complete (none left on the device),
    and the update stays bitwise the update without the tier."""
    model = _model(family, lora)
    ref_model = copy.deepcopy(model)
    inputs = _batch(model, "sft")
    options = {"partition_size": 4, "head_partition_size": 3, "head_mode": head_mode}  # 4 MLP tiles
    with streambp_core.prepare(ref_model, method, **options) as run:
        optimizer = run.adamw(lr=1e-2)
        for _ in range(2):
            run.loss(**inputs).backward()
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    with streambp_core.prepare(model, method, offload="optimizer", **options) as run:
        optimizer = run.adamw(lr=1e-2)
        trainable = {name: p for name, p in model.named_parameters() if p.requires_grad}
        for _ in range(2):
            run.loss(**inputs).backward()
            sends = {name: optimizer.pending_sends(p) for name, p in trainable.items()}
            assert sends == dict.fromkeys(trainable, 1)
            assert [name for name, p in trainable.items() if p.grad is not None] == []
            optimizer.step()
    assert not any(hasattr(p, unit_grads.HELD) for p in model.parameters())  # close() took the marks off
    for (name, value), ref in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert torch.equal(value, ref), name


class PoisonedHostParams(HostParams):
    """Released weights read as NaN: any computation that reads a weight outside its gather fails."""

    def release(self, index: int) -> None:
        super().release(index)
        for param in self._units[index]:
            if id(param) not in self._on_device:
                param.data = torch.full_like(self._host[id(param)], float("nan"))


@cells(("method", "family", "lora"), [(method, *model) for model in (("llama", 0), ("qwen2", 0), ("llama", 2))
                                      for method in ("checkpoint", "mst", "streambp")],
       {("checkpoint", "llama", 0), ("streambp", "qwen2", 0), ("mst", "llama", 2)})
def test_weights_are_read_only_while_gathered(monkeypatch, method, family, lora):
    monkeypatch.setattr(host_tier, "HostParams", PoisonedHostParams)
    model = _model(family, lora)
    ref_model = copy.deepcopy(model)
    inputs = _batch(model, "sft")
    with streambp_core.prepare(ref_model, method, partition_size=4, head_partition_size=3) as run:
        run.loss(**inputs).backward()
    run = streambp_core.prepare(model, method, partition_size=4, head_partition_size=3, offload="params")
    with run:
        assert isinstance(run.host_params, PoisonedHostParams)
        loss = run.loss(**inputs)
        assert run.host_params.gathered_units() == set()  # every unit released after the forward
        loss.backward()
        assert run.host_params.gathered_units() == set()
        grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    refs = [p.grad for p in ref_model.parameters() if p.grad is not None]
    assert grads and len(grads) == len(refs)
    for (name, grad), ref in zip(grads.items(), refs, strict=True):
        assert torch.equal(grad, ref), name


def test_the_host_pool_holds_weights_masters_and_moments():
    spec = StepSpec.of(model="tiny/llama", method="streambp", optimizer="adamw", offload=ALL, dtype="float64")
    model = _model("llama")
    params = sum(p.numel() for p in model.parameters())
    run = streambp_core.prepare(model, "streambp", partition_size=4, head_partition_size=3,
                                offload=spec.offload)
    with run:
        optimizer = run.adamw()
        inputs = _batch(model, "sft")
        with MemoryTracker(model, device="cpu") as tracker:
            tracker.track([*run.host_params.host_tensors(), *optimizer.host_tensors()], OFFLOADED)
            tracker.reset_peak()
            run.loss(**inputs).backward()
            optimizer.step()
        result = tracker.result()
    f64 = 8
    # host: weights + master (moments made by the step) + the gradients that went over
    assert result.host_end_bytes >= (1 + 1 + 2) * params * f64
    # every weight gathered twice but the embedding's (forward only), every gradient sent once
    embed = model.model.embed_tokens.weight.numel()
    assert result.to_device_bytes >= (2 * params - embed) * f64
    assert result.to_host_bytes >= params * f64
    # the device never held all the weights at once: at most two decoder layers and one other unit
    assert result.peak_breakdown_bytes["weights"] < params * f64


@pytest.mark.parametrize(("fields", "message"), [
    ({"method": "plain", "offload": "params"}, "cannot stream layers"),
    ({"method": "streambp", "offload": "checkpoints,disk"}, "must be one of none, checkpoints.*tier 'disk'"),
    ({"method": "streambp", "offload": "optimizer"}, "needs an optimizer"),
    ({"method": "streambp", "offload": "params", "optimizer": "adamw"}, "needs optimizer too"),
])
def test_bad_tier_sets_are_refused_in_one_line(fields, message):
    with pytest.raises(ConfigError, match=message) as err:
        StepSpec.of(model="tiny/llama", **fields)
    assert "\n" not in str(err.value)


def test_prepare_refuses_params_on_plain_and_takes_a_tuple():
    model = _model("llama")
    with pytest.raises(ConfigError, match="cannot stream layers"):
        streambp_core.prepare(model, "plain", offload=("params",))
    with streambp_core.prepare(model, "streambp", offload=("params", "checkpoints")) as run:
        assert str(run.config.offload) == "checkpoints,params"
        assert run.host_params is not None
    assert all(p.device.type == "cpu" for p in model.parameters())


@pytest.mark.parametrize("method", ["plain", "streambp"])
def test_close_takes_the_host_optimizers_hooks_off(method):
    """A run closed after stepping its host optimizer leaves the model plain: a plain run prepared on it
    next keeps its gradients on the parameters, equal to those of a model that never had the tier."""
    model = _model("qwen2")  # tied embedding and head
    ref_model = copy.deepcopy(model)
    inputs = _batch(model, "sft")
    with streambp_core.prepare(model, method, partition_size=4, head_partition_size=3,
                               offload="optimizer") as run:
        optimizer = run.adamw(lr=1e-2)
        run.loss(**inputs).backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    ref_model.load_state_dict(model.state_dict())
    for target in (model, ref_model):
        with streambp_core.prepare(target, "plain") as run:
            run.loss(**inputs).backward()
    assert optimizer.pending_sends(model.model.embed_tokens.weight) == 0
    for (name, p), q in zip(model.named_parameters(), ref_model.parameters(), strict=True):
        assert p.grad is not None and torch.equal(p.grad, q.grad), name


@cells(("method", "family"), [(method, family) for family in ("llama", "qwen2")  # untied; tied head
                              for method in ("checkpoint", "mst", "streambp")],
       {("checkpoint", "llama"), ("streambp", "qwen2")})
def test_params_tier_never_raises_the_simulated_peak(method, family):
    """Weights gathered a unit at a time are a subset of the resident weights, and nothing else changes:
    the params tier's simulated peak is at most the resident step's, with fewer weight bytes at it."""
    from streambp_core.step.simulation.simulate import simulate

    fields = dict(model=f"tiny/{family}", method=method, seq_len_tokens=300, partition_size=32,
                  head_partition_size=16)
    resident = simulate(StepSpec.of(offload="none", **fields))
    gathered = simulate(StepSpec.of(offload="params", **fields))
    assert gathered.peak_bytes <= resident.peak_bytes
    assert gathered.breakdown_bytes["weights"] < resident.breakdown_bytes["weights"]
    assert gathered.to_device_bytes > 0 and gathered.to_host_bytes == 0  # weights gathered, never written
