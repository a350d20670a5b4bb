"""CUDA helpers tested on a CPU: torch.cuda functions are patched and a fake pynvml module is injected."""

from __future__ import annotations

import dataclasses
import functools
import json
import sys
import types
from collections.abc import Iterator
from unittest import mock

import pytest
import torch
from torch._subclasses.fake_tensor import FakeTensorMode

from streambp_core.config import StepSpec
from streambp_core.measure import (
    GIB,
    CudaPeak,
    MemoryTracker,
    cuda_available,
    device_info,
    is_oom,
)
from streambp_core.models import load_config
from streambp_core.step.run import tracked as run_module
from streambp_core.step.run.setup import build_setup
from streambp_core.step.run.timing import time_step
from streambp_core.step.search import probe


class _NVMLError(Exception):
    pass


def _fake_pynvml(name: str | bytes = b"NVIDIA H100 80GB HBM3", fail: str = "") -> types.ModuleType:
    """A stand-in for nvidia-ml-py's `pynvml` with two devices; records the calls it gets."""
    module = types.ModuleType("pynvml")
    module.NVMLError = _NVMLError
    module.calls = []

    def init() -> None:
        module.calls.append("init")
        if fail == "init":
            raise _NVMLError("Driver Not Loaded")

    module.nvmlInit = init
    module.nvmlShutdown = lambda: module.calls.append("shutdown")
    module.nvmlDeviceGetHandleByIndex = lambda i: module.calls.append(("index", i)) or f"handle{i}"
    module.nvmlDeviceGetHandleByUUID = lambda u: module.calls.append(("uuid", u)) or f"handle-{u}"

    def get_name(handle: str) -> str | bytes:
        if fail == "name":
            raise _NVMLError("Unknown Error")
        return name

    module.nvmlDeviceGetName = get_name
    module.nvmlDeviceGetMemoryInfo = lambda handle: types.SimpleNamespace(
        total=80 * GIB, used=3 * GIB, free=77 * GIB
    )
    return module


@pytest.fixture
def no_visible_devices_env(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)


@pytest.fixture
def torch_gpu() -> Iterator[None]:
    """torch.cuda reporting one 140 GiB device."""
    props = types.SimpleNamespace(name="NVIDIA H200", total_memory=140 * GIB)
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.get_device_properties", return_value=props),
    ):
        yield


def test_cuda_available_follows_torch() -> None:
    with mock.patch("torch.cuda.is_available", return_value=True):
        assert cuda_available() is True
    with mock.patch("torch.cuda.is_available", return_value=False):
        assert cuda_available() is False


@pytest.mark.usefixtures("no_visible_devices_env")
def test_device_info_from_nvml_decodes_bytes_and_shuts_down() -> None:
    nvml = _fake_pynvml()
    with mock.patch.dict(sys.modules, {"pynvml": nvml}):
        info = device_info(1)
    assert (info.name, info.total_gib, info.used_gib, info.source, info.note) == (
        "NVIDIA H100 80GB HBM3",
        80.0,
        3.0,
        "nvml",
        "",
    )
    assert nvml.calls == ["init", ("index", 1), "shutdown"]


@pytest.mark.parametrize(
    ("visible", "expected_call"),
    [("3,5", ("index", 5)), ("GPU-abc, GPU-def", ("uuid", "GPU-def")), ("0", ("index", 1))],
)
def test_device_info_maps_torch_index_through_cuda_visible_devices(
    monkeypatch: pytest.MonkeyPatch, visible: str, expected_call: tuple
) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", visible)
    nvml = _fake_pynvml(name="NVIDIA A800-SXM4-80GB")
    with mock.patch.dict(sys.modules, {"pynvml": nvml}):
        assert device_info(1).name == "NVIDIA A800-SXM4-80GB"
    assert nvml.calls[1] == expected_call


@pytest.mark.usefixtures("torch_gpu")
def test_device_info_falls_back_to_torch_without_pynvml() -> None:
    with mock.patch.dict(sys.modules, {"pynvml": None}):  # None in sys.modules makes the import fail
        info = device_info()
    assert (info.name, info.total_gib, info.used_gib, info.source) == ("NVIDIA H200", 140.0, None, "torch")
    assert "pynvml not installed" in info.note and "streambp-bench[cuda]" in info.note


@pytest.mark.usefixtures("torch_gpu", "no_visible_devices_env")
@pytest.mark.parametrize(
    ("fail", "message", "calls"),
    [
        ("init", "Driver Not Loaded", ["init"]),
        ("name", "Unknown Error", ["init", ("index", 0), "shutdown"]),
    ],
)
def test_device_info_falls_back_to_torch_when_nvml_fails(fail: str, message: str, calls: list) -> None:
    nvml = _fake_pynvml(fail=fail)
    with mock.patch.dict(sys.modules, {"pynvml": nvml}):
        info = device_info()
    assert (info.source, info.total_gib) == ("torch", 140.0)
    assert f"NVML failed ({message})" in info.note
    assert nvml.calls == calls


def test_device_info_without_any_cuda_raises() -> None:
    with (
        mock.patch.dict(sys.modules, {"pynvml": None}),
        mock.patch("torch.cuda.is_available", return_value=False),
        pytest.raises(RuntimeError, match="no CUDA device available"),
    ):
        device_info()


def _allocator(peak_allocated: int, peak_reserved: int, stats: list[dict[str, int]]) -> mock._patch:
    """Patch torch.cuda's allocator statistics; `stats` are returned by successive memory_stats calls (the
    last one again once they run out)."""
    stats = list(stats)

    def memory_stats(*args: object) -> dict[str, int]:
        return stats.pop(0) if len(stats) > 1 else stats[0]

    return mock.patch.multiple(
        "torch.cuda",
        synchronize=mock.DEFAULT,
        reset_peak_memory_stats=mock.DEFAULT,
        max_memory_allocated=mock.Mock(return_value=peak_allocated),
        max_memory_reserved=mock.Mock(return_value=peak_reserved),
        memory_stats=mock.Mock(side_effect=memory_stats),
    )


def test_cuda_peak_resets_then_reads_allocator_peaks() -> None:
    stats = [{"num_alloc_retries": 4, "num_ooms": 1}, {"num_alloc_retries": 6, "num_ooms": 1}]
    with _allocator(3 * GIB, 5 * GIB, stats) as patched, CudaPeak("cuda:0") as peak:
        patched["reset_peak_memory_stats"].assert_called_once_with("cuda:0")
    assert (peak.peak_allocated_gib, peak.peak_reserved_gib) == (3.0, 5.0)
    assert (peak.num_alloc_retries, peak.num_ooms) == (2, 0)


class _FakeEvent:
    """A CUDA event reading a fake clock (ms) that the timed function advances."""

    clock_ms = 0.0

    def __init__(self, enable_timing: bool = False) -> None:
        assert enable_timing
        self.time_ms: float | None = None

    def record(self) -> None:
        self.time_ms = _FakeEvent.clock_ms

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end: _FakeEvent) -> float:
        assert self.time_ms is not None and end.time_ms is not None
        return end.time_ms - self.time_ms


def test_time_step_on_cuda_times_each_repeat_with_events_after_warmup() -> None:
    durations = iter([100.0, 5.0, 7.0, 6.0, 9.0, 8.0])  # the first call is the warm-up
    stats = [{"num_alloc_retries": 4, "num_ooms": 0}, {"num_alloc_retries": 5, "num_ooms": 0}]

    def fn() -> None:
        _FakeEvent.clock_ms += next(durations)

    with mock.patch("torch.cuda.Event", _FakeEvent), _allocator(GIB, GIB, stats):
        timing = time_step(fn, "cuda", warmup=1, repeats=5)
    assert timing.times_ms == (5.0, 7.0, 6.0, 9.0, 8.0)
    assert (timing.p20_ms, timing.p50_ms, timing.p80_ms) == (5.8, 7.0, 8.2)
    assert (timing.alloc_retries, timing.num_ooms) == (1, 0)


def test_time_step_rejects_bad_arguments() -> None:
    from streambp_core.config import ConfigError

    with pytest.raises(ConfigError, match="repeats >= 1"):
        time_step(lambda: None, "cpu", repeats=0)


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB"), True),
        (RuntimeError("CUDA out of memory. Tried to allocate 20.00 MiB (GPU 0; 79.15 GiB total)"), True),
        (RuntimeError("CUDA error: CUBLAS_STATUS_ALLOC_FAILED when calling `cublasCreate(handle)`"), True),
        (
            RuntimeError("[enforce fail at alloc_cpu.cpp:117] DefaultCPUAllocator: can't allocate memory"),
            True,
        ),
        (MemoryError(), True),
        (RuntimeError("CUDA error: device-side assert triggered"), False),
        (ValueError("CUDA out of memory"), False),
    ],
)
def test_is_oom(exc: BaseException, expected: bool) -> None:
    assert is_oom(exc) is expected


def test_tracker_reports_allocator_peaks_when_cuda_is_requested() -> None:
    stats = [{"num_alloc_retries": 0, "num_ooms": 0}] * 4
    with _allocator(2 * GIB, 4 * GIB, stats) as patched:
        with MemoryTracker(cuda=True) as tracker:
            tracker.reset_peak()
        assert patched["reset_peak_memory_stats"].call_count == 2  # at entry and at reset_peak
    result = tracker.result()
    assert (result.cuda_peak_allocated_gib, result.cuda_peak_reserved_gib) == (2.0, 4.0)


def _cuda_forbidden() -> mock._patch:
    boom = mock.Mock(side_effect=AssertionError("torch.cuda touched"))
    return mock.patch.multiple(
        "torch.cuda", is_available=boom, reset_peak_memory_stats=boom, synchronize=boom
    )


def test_tracker_leaves_torch_cuda_alone_for_cpu_and_fake_cuda_models() -> None:
    with FakeTensorMode():
        fake_cuda_model = torch.nn.Module()
        fake_cuda_model.weight = torch.nn.Parameter(torch.empty(4, 4, device="cuda"))
    with _cuda_forbidden():
        for model in (torch.nn.Linear(4, 4), None):
            with MemoryTracker(model) as tracker:
                pass
            assert tracker.result().cuda_peak_allocated_bytes is None
    with (
        mock.patch("torch.cuda.is_available", return_value=True),
        mock.patch("torch.cuda.synchronize") as sync,
    ):
        with MemoryTracker(fake_cuda_model) as tracker:
            pass
        sync.assert_not_called()
    assert tracker.result().end_breakdown_bytes["weights"] == 4 * 4 * 4


def test_tracker_reports_the_allocators_retries_and_ooms_over_the_region() -> None:
    stats = [{"num_alloc_retries": 4, "num_ooms": 1}, {"num_alloc_retries": 6, "num_ooms": 1}]
    with _allocator(2 * GIB, 4 * GIB, stats), MemoryTracker(cuda=True) as tracker:
        pass
    result = tracker.result()
    assert (result.cuda_num_alloc_retries, result.cuda_num_ooms) == (2, 0)
    with MemoryTracker(torch.nn.Linear(2, 2)) as cpu_tracker:
        pass
    assert (cpu_tracker.result().cuda_num_alloc_retries, cpu_tracker.result().cuda_num_ooms) == (None, None)


@pytest.fixture
def tiny_setup():
    spec = StepSpec.of(model="tiny/qwen3", method="streambp", seq_len_tokens=48, dtype="float32",
                       partition_size=32, head_partition_size=16)  # fmt: skip
    return build_setup(spec, load_config(spec.model), "cpu")


def test_measure_step_reports_the_allocators_figures_and_they_survive_the_child_json(
    monkeypatch: pytest.MonkeyPatch, tiny_setup
) -> None:
    """A real CPU step whose tracker also reads a (mocked) CUDA allocator: 2 retries in the first phase,
    none after; the reserved peak is the phases' largest."""
    monkeypatch.setattr(run_module, "MemoryTracker", functools.partial(MemoryTracker, cuda=True))
    stats = [{"num_alloc_retries": 1, "num_ooms": 3}, {"num_alloc_retries": 3, "num_ooms": 3}]
    with _allocator(3 * GIB, 5 * GIB, stats):
        result = probe.measure_setup(tiny_setup, "cpu")
    assert result.status == "ok" and 0 < result.peak_bytes < GIB  # the tracker's peak on CPU
    assert (result.peak_reserved_bytes, result.alloc_retries, result.num_ooms) == (5 * GIB, 2, 0)
    line = json.dumps(dataclasses.asdict(result))
    assert probe.parse_child_output(48, 0, f"noise\n{line}\n", "") == result


def test_an_oom_step_reports_the_allocators_oom_count(monkeypatch: pytest.MonkeyPatch, tiny_setup) -> None:

    def out_of_memory(*args: object, **kwargs: object) -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")

    fake_run = types.SimpleNamespace(loss=out_of_memory, close=lambda: None, host_params=None)
    monkeypatch.setattr(run_module, "prepare", lambda *args, **kwargs: fake_run)
    monkeypatch.setattr(run_module, "MemoryTracker", functools.partial(MemoryTracker, cuda=True))
    stats = [{"num_alloc_retries": 0, "num_ooms": 0}, {"num_alloc_retries": 1, "num_ooms": 1}]
    with _allocator(3 * GIB, 5 * GIB, stats):
        result = probe.measure_setup(tiny_setup, "cpu")
    assert result.status == "oom" and result.message.startswith("CUDA out of memory")
    assert (result.alloc_retries, result.num_ooms, result.peak_bytes) == (1, 1, None)


def test_measure_step_on_cpu_leaves_the_allocator_figures_empty(tiny_setup) -> None:
    with _cuda_forbidden():
        result = probe.measure_setup(tiny_setup, "cpu")
    assert result.status == "ok" and result.peak_bytes > 0
    assert (result.peak_reserved_bytes, result.alloc_retries, result.num_ooms) == (None, None, None)
