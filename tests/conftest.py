"""Shared test settings: the `gpu` marker skips without CUDA; a CLI runner; the tiny presets' names;
searches in the test process (STREAMBP_BENCH_JOBS=1: tests of worker processes pass --jobs themselves);
synthetic probes and simulations for the tests of the CLI's wiring (`stub_probe`, `stub_simulation`).

Markers (pyproject.toml): `gpu` needs a CUDA device; `slow` marks a long matrix or a test of over ~3 s
on 2 CPU cores. The default run (`python3 -m pytest -q -n 2`, README's test command, on two pytest-xdist
workers) leaves `slow` out; `python3 -m pytest -q -m slow` runs them (CI's second step). Every test
starts from the same seeds (`seeded`) and on one torch thread (`one_thread`), so no test depends on what
ran before it, nor on which worker runs it.
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


@pytest.fixture(autouse=True)
def one_thread():
    """Torch on one thread for every test, restored after it: the tests' tiny models run fastest so (two
    threads spin against each other on 2 cores, and more so on cores shared with other work)."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture
def runner() -> CliRunner:
    """Typer's runner for the real `streambp-bench` app."""
    return CliRunner()


class SyntheticSteps:
    """Synthetic training steps for the tests of the CLI's wiring (`stub_probe`, `stub_simulation`): the
    peak of a step at T tokens is what it holds whatever its length (weights, grads, optimizer state) plus
    bytes per token (plain's the most, streambp's the least, in the simulator's order; a test may change
    them) x T x batch, half of that in host memory when the step offloads. Records every spec a stub was
    asked about, in order."""

    def __init__(self) -> None:
        self.bytes_per_token = {"plain": 16 * 1024, "checkpoint": 4 * 1024, "mst": 3 * 1024, "streambp": 1024}
        self.specs: list = []

    def peak(self, spec, config, held: int | None = None) -> dict:
        """The step's figures: peak_bytes, breakdown_bytes and the host pool's bytes (`held`: what the
        step holds whatever its length, when the caller has it)."""
        from streambp_core.step.run.setup import resident_bytes

        held = resident_bytes(spec, config) if held is None else held
        activations = self.bytes_per_token[spec.method] * spec.batch_size * spec.seq_len_tokens
        host = activations // 2 if spec.offload else 0
        device = activations - host
        breakdown = {"weights": held, "checkpoints": device // 2, "temporaries": device - device // 2}
        return {"peak_bytes": held + device, "breakdown_bytes": breakdown, "host_peak_bytes": host,
                "to_host_bytes": host, "to_device_bytes": host}


@pytest.fixture
def stub_probe(monkeypatch: pytest.MonkeyPatch) -> SyntheticSteps:
    """A max-len search's probes synthetic (`SyntheticSteps`) instead of simulated, at the seam `max-len`
    calls (`streambp_core.step.search.probe.simulated_probe`): a search takes milliseconds, the rest of the
    command runs as it stands (with `searches_in_process`: no worker process to miss the stub)."""
    from streambp_core.search import OK, ProbeResult
    from streambp_core.step.run.setup import resident_bytes
    from streambp_core.step.search import probe as probe_module

    steps = SyntheticSteps()

    def synthetic_probe(spec, model, *, depth: str = "extrapolate"):
        steps.specs.append(spec)
        held = resident_bytes(spec, model.config)
        layers = f"all {model.num_layers} layers" if depth == "full" else "2 and 3 layers, extrapolated"

        def probe(seq_len: int) -> ProbeResult:
            return ProbeResult(seq_len_tokens=seq_len, status=OK, source="simulated",
                               message=f"simulated on meta tensors (stubbed probe), {layers}",
                               **steps.peak(spec.at(seq_len), model.config, held))

        return probe

    monkeypatch.setattr(probe_module, "simulated_probe", synthetic_probe)
    return steps


@pytest.fixture
def stub_simulation(monkeypatch: pytest.MonkeyPatch) -> SyntheticSteps:
    """Simulated steps synthetic (`SyntheticSteps`) wherever a command calls
    `streambp_core.step.simulation.simulate.simulate` at run time (a sweep's simulated point), so a test of
    the command's wiring runs its points in milliseconds."""
    from streambp_core.step.parts.resolved import ResolvedModel
    from streambp_core.step.simulation import simulate as simulate_module

    steps = SyntheticSteps()

    def synthetic_simulate(spec, model=None, *, depth: str = "extrapolate", **_):
        steps.specs.append(spec)
        resolved = ResolvedModel.of(spec.model if model is None else model)
        return simulate_module.SimResult(spec=spec, num_layers=resolved.num_layers,
                                         layers_simulated=(resolved.num_layers,),
                                         **steps.peak(spec, resolved.config))

    monkeypatch.setattr(simulate_module, "simulate", synthetic_simulate)
    return steps


@pytest.fixture
def stub_verify(monkeypatch: pytest.MonkeyPatch) -> list:
    """`verify`'s check synthetic, at the seam the command calls (`streambp_core.verify.methods.verify_spec`):
    every method of the spec matches plain exactly (an update error of 0 with an optimizer), so a test of
    the command's wiring (which methods reach the check, notes, output) runs in milliseconds. Returns the
    specs checked, in order."""
    from streambp_core.verify import methods as verify_module

    checked: list = []

    def synthetic_verify(spec, progress=None):
        checked.append(spec)
        update = None if spec.step.optimizer == "none" else 0.0
        results = tuple(verify_module.MethodResult(
            method=method, max_rel_err=0.0, worst_param="model.embed_tokens.weight", loss=1.0,
            loss_abs_err=0.0, tolerance=1e-12, loss_tolerance=1e-12, max_update_err=update, ok=True)
            for method in spec.methods)
        return verify_module.VerifyReport(spec=spec, results=results, reference_loss=1.0,
                                          reference_dtype=spec.step.dtype)

    monkeypatch.setattr(verify_module, "verify_spec", synthetic_verify)
    return checked


@pytest.fixture(scope="session")
def every_preset_row() -> list[dict]:
    """`presets`' row of every preset (`commands.presets.preset_rows`: each model built on meta), built once
    per session."""
    from streambp_bench.commands.presets import preset_rows

    return preset_rows()


@pytest.fixture
def presets_built_once(monkeypatch: pytest.MonkeyPatch, every_preset_row: list[dict]) -> list[dict]:
    """`presets` prints `every_preset_row` (copies) instead of building every preset again: for the tests
    of its output."""
    from streambp_bench.commands import presets as presets_module

    monkeypatch.setattr(presets_module, "preset_rows", lambda: [dict(row) for row in every_preset_row])
    return every_preset_row
