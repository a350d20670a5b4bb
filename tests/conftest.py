"""Shared test settings: the `gpu` marker skips without CUDA; a CLI runner; the tiny presets' names;
searches in the test process (STREAMBP_BENCH_JOBS=1: tests of worker processes pass --jobs themselves).

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
