"""The self-check's kernel-workspace step: streambp with its attention backward blocked and unblocked,
measured next to simulated, judged within 3%, and its summary table."""

from __future__ import annotations

import dataclasses
from unittest import mock

from rich.console import Console

from streambp_bench.results import rows_to_frame
from streambp_bench.selfcheck import check
from streambp_bench.selfcheck import report as selfcheck_report
from streambp_core.measure.units import GIB
from streambp_core.search import ProbeResult


def test_the_gpu_plan_checks_64k_and_128k_and_the_dry_run_lists_the_step():
    assert check.GPU_PLAN.workspace_lengths == (65536, 131072)
    assert check.CPU_PLAN.workspace_lengths  # the CPU dry run runs the same code


def _run(plan, simulated_over_measured: dict[bool, float]):
    """workspace_rows with the measurement faked (1 GiB) and the simulation faked at the given ratio per
    blocking; returns (rows, specs simulated)."""
    simulated_specs = []

    def measured(setup, device):
        return ProbeResult(seq_len_tokens=setup.spec.seq_len_tokens, status="ok", peak_bytes=GIB,
                           source="measured-cuda")

    def simulated(spec, config):
        simulated_specs.append(spec)
        peak = int(GIB * simulated_over_measured[spec.stream.attn_blocking])
        return ProbeResult(seq_len_tokens=spec.seq_len_tokens, status="ok", peak_bytes=peak,
                           breakdown_bytes={"kernel_workspace": GIB // 8}, source="simulated")

    with (mock.patch.object(check, "measure_setup", measured),
          mock.patch.object(check, "_simulated", simulated),
          mock.patch.object(check, "attention_kernels", return_value=("flash", "sdpa"))):
        rows = list(check.workspace_rows(plan, check.memory_model(plan), "NVIDIA H200"))
    return rows, simulated_specs


def test_workspace_rows_pair_each_measurement_with_its_simulation_and_judge_it():
    """Per attention kernel, unblocked then blocked, per length: a measured and a simulated row of the
    same step; a simulation more than 3% off the allocator's peak is an error row."""
    plan = dataclasses.replace(check.CPU_PLAN, workspace_lengths=(96, 144))
    rows, specs = _run(plan, {False: 1.05, True: 1.02})
    assert [(s.stream.attn, s.stream.attn_blocking, s.seq_len_tokens) for s in specs] == [
        (attn, blocking, n) for attn in ("flash", "sdpa") for blocking in (False, True) for n in (96, 144)]
    assert {s.method for s in specs} == {"streambp"}
    measured = [r for r in rows if r.source == "measured-cuda"]
    simulated = [r for r in rows if r.source == "simulated"]
    assert len(measured) == len(simulated) == 8 and all(r.status == "ok" for r in measured)
    metrics = {r.metric: r.status for r in simulated}
    assert metrics == {"peak_memory_unblocked": "error", "peak_memory_blocked": "ok"}
    assert all("outside 3%" in r.error for r in simulated if r.status == "error")
    assert {r.kernel_workspace_gib for r in simulated} == {0.125}


def test_the_summary_has_a_kernel_workspace_table():
    plan = dataclasses.replace(check.CPU_PLAN, workspace_lengths=(96,))
    rows, _ = _run(plan, {False: 1.0, True: 0.99})
    console = Console(record=True, width=200)
    selfcheck_report.print_summary(console, rows_to_frame(rows), "NVIDIA H200")
    text = console.export_text()
    assert "kernel workspace: streambp peak GiB" in text
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in text.splitlines() if "unblocked" in line
             and "│" in line]
    assert sorted(cell[0] for cell in cells) == ["flash", "sdpa"]
    assert {tuple(cell[3:]) for cell in cells} == {("1", "1", "1.000", "0.125", "ok")}
