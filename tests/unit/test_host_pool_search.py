"""Two memory pools: the search bounded by a host budget, and an out-of-host-memory step as a data point."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import StepSpec
from streambp_core.engine.host import checkpoints as offload_module
from streambp_core.measure import is_oom
from streambp_core.measure.cuda import oom_pool
from streambp_core.models import load_config
from streambp_core.search import OK, OOM, ProbeResult, default_tolerance, guided_max_len, max_trainable_length
from streambp_core.step.run.setup import build_setup
from streambp_core.step.search import probe

GIB = 2**30


def two_pools(device_bytes_per_token: float, host_bytes_per_token: float):
    """probe(seq_len): device peak 1 GiB + a slope, host peak a slope (offloaded checkpoints)."""
    def probe_at(t: int) -> ProbeResult:
        return ProbeResult(seq_len_tokens=t, status=OK, peak_bytes=int(GIB + device_bytes_per_token * t),
                           host_peak_bytes=int(host_bytes_per_token * t), source="simulated")
    return probe_at


@pytest.mark.parametrize("host_budget_gib", [None, 400.0, 100.0, 20.0])
def test_the_search_stops_where_the_fuller_pool_is_full(host_budget_gib: float | None) -> None:
    device_slope, host_slope, budget = 30 * 1024, 300 * 1024, 80 * GIB
    host_budget = None if host_budget_gib is None else int(host_budget_gib * GIB)
    limits = [(budget - GIB) / device_slope] + ([] if host_budget is None else [host_budget / host_slope])
    result = max_trainable_length(two_pools(device_slope, host_slope), budget, host_budget_bytes=host_budget)
    lo, hi = result.bracket
    assert lo <= min(limits) < hi and hi - lo <= default_tolerance(lo)
    assert result.peak_at_max.fits(budget, host_budget) and result.host_budget_bytes == host_budget
    assert len(result.probes) <= 8  # the secant follows the fuller pool; no bisection crawl


def test_a_guided_search_confirms_against_both_pools() -> None:
    guide = two_pools(30 * 1024, 300 * 1024)
    deeper = two_pools(30 * 1024, 330 * 1024)  # the full depth holds more on the host than the guide says
    result = guided_max_len(guide, 80 * GIB, confirm=deeper, confirmed_layers=36, host_budget_bytes=100 * GIB)
    assert result.peak_at_max.host_peak_bytes <= 100 * GIB
    assert result.max_len_tokens <= 100 * GIB / (330 * 1024) < result.bracket[1]


def test_without_a_host_budget_the_host_pool_is_reported_not_bounded() -> None:
    huge_host = ProbeResult(seq_len_tokens=8, status=OK, peak_bytes=GIB, host_peak_bytes=10**6 * GIB)
    assert huge_host.fits(80 * GIB) and not huge_host.fits(80 * GIB, 100 * GIB)
    assert huge_host.over_host_budget(100 * GIB) and not huge_host.over_host_budget(None)


PINNED_OOM = "CUDA error: out of memory\nCUDA kernel errors might be asynchronously reported at another API"


@pytest.mark.parametrize(
    ("exc", "pool"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), "device"),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate`"), "device"),
        (RuntimeError(PINNED_OOM), "host"),  # cudaHostAlloc failing in the pinned-host allocator
        (RuntimeError("[enforce fail] DefaultCPUAllocator: can't allocate memory"), "host"),
        (MemoryError(), "host"),
        (RuntimeError("CUDA error: device-side assert triggered"), None),
    ],
)
def test_oom_pool_names_the_memory_that_ran_out(exc: BaseException, pool: str | None) -> None:
    assert oom_pool(exc) == pool and is_oom(exc) is (pool is not None)


@pytest.fixture
def offloaded_setup():
    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=48, dtype="float32",
                       partition_size=32, head_partition_size=16, offload="checkpoints")
    return build_setup(spec, load_config(spec.model), "cpu")


def test_a_step_short_of_pinned_host_memory_is_an_oom_data_point(monkeypatch, offloaded_setup) -> None:
    """The pinned-host allocator failing mid-step (mocked: the real offloaded step's second host copy
    raises what torch raises when cudaHostAlloc fails) gives status oom, pool host, and the search goes
    on below it."""
    real_host_copy, calls = offload_module.host_copy, []

    def pinned_alloc_fails(tensor: torch.Tensor) -> torch.Tensor:
        calls.append(tensor.shape)
        if len(calls) > 1:
            raise RuntimeError(PINNED_OOM)
        return real_host_copy(tensor)

    monkeypatch.setattr(offload_module, "host_copy", pinned_alloc_fails)
    result = probe.measure_setup(offloaded_setup, "cpu")
    assert len(calls) == 2
    assert (result.status, result.oom_pool, result.peak_bytes) == (OOM, "host", None)
    assert result.message.startswith("CUDA error: out of memory")

    def measured(t: int) -> ProbeResult:
        return result if t > 1000 else two_pools(1024, 1024)(t)

    search = max_trainable_length(measured, 80 * GIB, host_budget_bytes=None)
    assert 0 < search.max_len_tokens <= 1000 and any(p.oom_pool == "host" for p in search.probes)


def test_a_child_killed_for_memory_or_out_of_pinned_memory_is_a_host_oom() -> None:
    killed = probe.parse_child_output(4096, -9, "", "Killed")
    pinned = probe.parse_child_output(4096, 1, "", f"Traceback ...\nRuntimeError: {PINNED_OOM}")
    device = probe.parse_child_output(4096, 1, "", "torch.OutOfMemoryError: CUDA out of memory. Tried")
    assert [(r.status, r.oom_pool) for r in (killed, pinned, device)] == [
        (OOM, "host"), (OOM, "host"), (OOM, "device")
    ]
