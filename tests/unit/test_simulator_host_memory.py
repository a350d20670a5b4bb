"""A simulation costs no host memory in proportion to its length, and the host running out of memory
during one is an error, never a simulated out-of-memory data point."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from streambp_core.config import StepSpec
from streambp_core.measure.cuda import HostMemoryFailure, is_oom
from streambp_core.search import ProbeResult, max_trainable_length
from streambp_core.step.simulation import simulate as simulate_module

REPO = Path(__file__).parents[2]

GROWTH = """
import resource
from streambp_core.config import StepSpec
from streambp_core.step.simulation.simulate import simulate
simulate(StepSpec(model="tiny/llama", method="streambp", seq_len_tokens=4096, batch_size=2))
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
simulate(StepSpec.of(model="tiny/llama", method="streambp", seq_len_tokens=1_000_000, batch_size=64,
                     objective="{objective}"))
print((resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before) // 1024)
"""


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["sft", "grpo"])
def test_a_long_simulation_holds_no_inputs_in_host_memory(objective: str) -> None:
    code = GROWTH.replace("{objective}", objective)
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO, check=True,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"})
    grown_mib = int(done.stdout.split()[-1])
    assert grown_mib < 128, f"64 x 1M tokens grew the host's peak by {grown_mib} MiB"  # real ids: >= 512


def test_the_host_running_out_during_a_simulation_is_an_error(monkeypatch) -> None:
    def no_memory(*args, **kwargs):
        raise RuntimeError("[enforce fail at alloc_cpu.cpp:121] DefaultCPUAllocator: can't allocate memory")

    monkeypatch.setattr(simulate_module, "tracked_step", no_memory)
    with pytest.raises(HostMemoryFailure, match="ran out of this machine's memory") as caught:
        simulate_module.simulate(StepSpec(model="tiny/llama", method="streambp", seq_len_tokens=64))
    assert not is_oom(caught.value)


def test_a_search_does_not_count_a_host_failure_as_an_oom() -> None:
    def probe(seq_len: int) -> ProbeResult:
        if seq_len > 4096:
            raise HostMemoryFailure("the simulation ran out of this machine's memory")
        return ProbeResult(seq_len_tokens=seq_len, status="ok", peak_bytes=seq_len)

    with pytest.raises(HostMemoryFailure):
        max_trainable_length(probe, budget_bytes=10**9)
