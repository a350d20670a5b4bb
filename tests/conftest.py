"""Shared test settings: the `gpu` marker skips without CUDA; a CLI runner; the tiny presets' names;
searches in the test process (STREAMBP_BENCH_JOBS=1: tests of worker processes pass --jobs themselves);
synthetic probes for the tests of the CLI's wiring (`stub_probe`).

Markers (pyproject.toml): `gpu` needs a CUDA device; `slow` marks a long matrix or a test of over ~3 s
on 2 CPU cores. The default run (`python3 -m pytest -q`, README's test command) leaves `slow` out;
`python3 -m pytest -q -m slow` runs them (CI's second step). Every test starts from the same seeds
(`seeded`), so no test depends on what ran before it.
"""

from __future__ import annotations

import pytest
import torch
from typer.testing import CliRunner

TINY_PRESETS = ("tiny/llama", "tiny/qwen2", "tiny/qwen3", "tiny/mistral")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Skip `gpu` tests when no CUDA device is present."""
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def seeded() -> None:
    """Every test draws from the same seeds, whatever ran before it (Python's, torch's)."""
    import random

    import torch

    random.seed(0)
    torch.manual_seed(0)


@pytest.fixture(autouse=True)
def searches_in_process(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every command runs its searches in the test process unless a test passes --jobs."""
    monkeypatch.setenv("STREAMBP_BENCH_JOBS", "1")


@pytest.fixture
def one_thread():
    """Torch on one thread for the test: tiny float64 models run fastest so (two threads spin against each
    other on 2 cores). Used by the trainer tests (`pytest.mark.usefixtures("one_thread")`)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def runner() -> CliRunner:
    """Typer's runner for the real `streambp-bench` app."""
    return CliRunner()



class StubbedProbes:
    """What `stub_probe` probes with and records: bytes per token and sequence by method (plain's the most,
    streambp's the least, in the simulator's order; a test may change them) and every spec a search
    probed, in order."""

    def __init__(self) -> None:
        self.bytes_per_token = {"plain": 16 * 1024, "checkpoint": 4 * 1024, "mst": 3 * 1024, "streambp": 1024}
        self.specs: list = []


@pytest.fixture
def stub_probe(monkeypatch: pytest.MonkeyPatch) -> StubbedProbes:
    """A search's probes synthetic instead of simulated, at the seam `max-len` calls
    (`streambp_core.step.probe.simulated_probe`): the peak at T tokens is what the step holds whatever its
    length (weights, grads, optimizer state) plus bytes per token (`StubbedProbes`) x T x batch, half of
    that in host memory when the step offloads. For the tests of the CLI's wiring (flags reach the step,
    output formats, errors): a search takes milliseconds, the rest of the command runs as it stands (with
    `searches_in_process`: no worker process to miss the stub)."""
    from streambp_core.search import OK, ProbeResult
    from streambp_core.step import probe as probe_module
    from streambp_core.step.setup import resident_bytes

    stubbed = StubbedProbes()

    def synthetic_probe(spec, model, *, depth: str = "extrapolate"):
        stubbed.specs.append(spec)
        held = resident_bytes(spec, model.config)
        per_token = stubbed.bytes_per_token[spec.method] * spec.batch_size
        layers = f"all {model.num_layers} layers" if depth == "full" else "2 and 3 layers, extrapolated"

        def probe(seq_len: int) -> ProbeResult:
            activations = per_token * seq_len
            host = activations // 2 if spec.offload else 0
            device = activations - host
            breakdown = {"weights": held, "checkpoints": device // 2, "temporaries": device - device // 2}
            return ProbeResult(
                seq_len_tokens=seq_len, status=OK, peak_bytes=held + device, source="simulated",
                breakdown_bytes=breakdown, message=f"simulated on meta tensors (stubbed probe), {layers}",
                host_peak_bytes=host, to_host_bytes=host, to_device_bytes=host)

        return probe

    monkeypatch.setattr(probe_module, "simulated_probe", synthetic_probe)
    return stubbed
