"""A CUDA step short of pinned host memory is an out-of-memory data point naming the pool 'host pinned'.

Mocked on a CPU: host copies are made to be pinned (`offload.pins_host_copies`), and torch's allocation
of a pinned tensor is replaced by one that fails as torch fails when `cudaHostAlloc` cannot pin (a CUDA
error, not the device allocator's OutOfMemoryError) at a chosen pinned allocation of a real step with
every tier (checkpoints, optimizer, params): while the step is set up, while it is prepared, in backward.
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from streambp_core.config import StepSpec
from streambp_core.engine.host import checkpoints as offload_module
from streambp_core.engine.host.params import HostParams
from streambp_core.measure.cuda import PinnedHostOutOfMemory, is_oom, oom_pool, pinned_host_allocation
from streambp_core.models import load_config
from streambp_core.search import HOST_PINNED_POOL, OK, OOM, ProbeResult, max_trainable_length
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search import probe

GIB = 2**30
PINNED_OOM = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at another API"
"""What torch raises when its pinned-host allocator's cudaHostAlloc fails."""
SPEC = StepSpec.of(model="tiny/llama", method="streambp", seq_len_tokens=48, dtype="float32",
                   partition_size=32, head_partition_size=16, optimizer="adamw",
                   offload="checkpoints,optimizer,params")


def _pinned_allocations(monkeypatch: pytest.MonkeyPatch, fail_at: int | None) -> list[int]:
    """Make every host copy a pinned one whose allocation is counted (list of sizes in bytes) and fails,
    as cudaHostAlloc does, at the `fail_at`-th (1-based; None: never)."""
    real_empty_like, sizes = torch.empty_like, []

    def empty_like(tensor: torch.Tensor, *args, pin_memory: bool = False, **kwargs) -> torch.Tensor:
        if pin_memory:
            sizes.append(tensor.numel() * (kwargs.get("dtype") or tensor.dtype).itemsize)
            if len(sizes) == fail_at:
                raise RuntimeError(PINNED_OOM)
        return real_empty_like(tensor, *args, **kwargs)  # a CPU-only torch cannot pin

    monkeypatch.setattr(offload_module, "pins_host_copies", lambda tensor: tensor.device.type == "cpu")
    monkeypatch.setattr(torch, "empty_like", empty_like)
    return sizes


def _device_full(*args: object) -> None:
    raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")


def test_the_pinned_pool_is_named_only_where_pinning_failed() -> None:
    with pytest.raises(PinnedHostOutOfMemory) as caught, pinned_host_allocation(3 * GIB, "a layer's input"):
        raise RuntimeError(PINNED_OOM)
    assert oom_pool(caught.value) == HOST_PINNED_POOL and is_oom(caught.value)
    assert str(caught.value).startswith(f"out of memory in pool '{HOST_PINNED_POOL}'")
    assert f"a layer's input of {3 * GIB:,} B (3.00 GiB)" in str(caught.value)
    with pytest.raises(torch.OutOfMemoryError), pinned_host_allocation(GIB):  # a device OOM stays one
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    with pytest.raises(ValueError), pinned_host_allocation(GIB):  # no OOM: propagates as it is
        raise ValueError("bad shape")


@pytest.mark.parametrize("where", ["setup", "prepare", "backward"])
def test_a_step_out_of_pinned_host_memory_is_an_oom_naming_the_pool(monkeypatch, capsys, where: str) -> None:
    """The real step with every tier; the pinned allocation that fails is the first made while the step
    is set up (the host optimizer's masters: a CUDA probe's child process reports it), while it is
    prepared (the params tier's weights) or the last (a gradient sent to the host in backward; closing
    the failed run then runs out of device memory too, which must not hide the first failure)."""
    config = load_config(SPEC.model)
    counted = _pinned_allocations(monkeypatch, fail_at=None)
    setup = build_setup(SPEC, config, "cpu")
    in_setup = len(counted)
    assert probe.measure_setup(setup, "cpu").status == OK
    total = len(counted)
    assert 0 < in_setup and total > in_setup + 2 * config.num_hidden_layers  # weights, inputs, gradients

    monkeypatch.undo()
    fail_at = {"setup": 1, "prepare": in_setup + 1, "backward": total}[where]
    sizes = _pinned_allocations(monkeypatch, fail_at=fail_at)
    if where == "backward":  # closing the failed run, putting the weights back on a full device, fails too
        monkeypatch.setattr(HostParams, "close", _device_full)
    if where == "setup":
        assert probe._child_main(["--spec", json.dumps(SPEC.to_dict()), "--device", "cpu"]) == 0
        result = probe.parse_child_output(SPEC.seq_len_tokens, 0, capsys.readouterr().out, "")
    else:
        result = probe.measure_setup(build_setup(SPEC, config, "cpu"), "cpu")
    assert len(sizes) == fail_at
    assert (result.status, result.oom_pool, result.peak_bytes) == (OOM, HOST_PINNED_POOL, None)
    assert result.message.startswith(f"out of memory in pool '{HOST_PINNED_POOL}'")
    assert f"of {sizes[-1]:,} B" in result.message
    line = json.dumps(dataclasses.asdict(result))  # a CUDA probe's child prints it as one JSON line
    assert probe.parse_child_output(SPEC.seq_len_tokens, 0, line, "") == result
    assert result.over_host_budget(None)  # out of host memory whatever the host budget

    def measured(t: int) -> ProbeResult:  # the search takes it as a failing length and goes on below
        fits = ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=GIB + 1024 * t, source="measured-cuda")
        return fits if t <= 1000 else dataclasses.replace(result, seq_len_tokens=t)

    search = max_trainable_length(measured, 80 * GIB)
    assert 0 < search.max_len_tokens <= 1000
    assert any(p.oom_pool == HOST_PINNED_POOL for p in search.probes)


def test_a_child_that_died_out_of_pinned_memory_names_the_pool() -> None:
    stderr = f"Traceback ...\nPinnedHostOutOfMemory: out of memory in pool '{HOST_PINNED_POOL}' (...)"
    died = probe.parse_child_output(4096, 1, "", stderr)
    assert (died.status, died.oom_pool) == (OOM, HOST_PINNED_POOL)
