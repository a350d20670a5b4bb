"""`streambp-bench selfcheck`: without CUDA it says so, runs the same code paths on CPU and exits 0."""

from __future__ import annotations

import dataclasses
from unittest import mock

import pytest
from rich.console import Console
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile, rows_to_frame
from streambp_bench.selfcheck import check
from streambp_bench.selfcheck import report as selfcheck_report
from streambp_core.measure.units import GIB
from streambp_core.search import ProbeResult


@pytest.mark.slow
def test_cpu_dry_run_writes_every_kind_of_row(tmp_path):
    result = CliRunner().invoke(app, ["selfcheck", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "No CUDA device" in result.output
    frame = ResultsFile(tmp_path / "selfcheck-cpu-dry-run.csv").load()
    plan = check.CPU_PLAN
    checked = frame[frame.metric == "grad_rel_err"]
    assert (checked.status == "ok").all()
    assert (checked.value < 1e-4).all()  # float32 on CPU: exact up to rounding
    grads = checked[checked.model == plan.verify_model]
    assert set(grads.objective) == set(plan.objectives)
    families = checked[checked.model != plan.verify_model]
    assert set(zip(families.model, families.method, strict=True)) == {
        (model, method) for model in plan.family_models for method in check.METHODS[1:]}
    memory = frame[frame.metric == "peak_memory"]
    assert set(memory.source) == {"measured-cpu", "simulated"}
    assert len(memory) == 2 * len(check.METHODS) * len(plan.lengths)
    pairs = memory.pivot_table(index=["method", "seq_len_tokens"], columns="source", values="value")
    ratio = pairs["simulated"] / pairs["measured-cpu"]
    assert ratio.between(0.9, 1.01).all(), ratio  # the simulator predicts the tracked CPU peak
    times = frame[frame.metric == "step_time"]
    assert set(times.method) == {"checkpoint", "streambp"} and (times.step_time_ms > 0).all()
    third = times.partition_size == [-(-n // 3) for n in times.seq_len_tokens]
    variants = set(zip(times[third].method, times[third].head_partition_size, strict=True))
    assert variants == {("checkpoint", plan.head_partition_size)} | {
        ("streambp", p) for p in plan.timed_head_partitions if p != check.AUTO}
    auto = times[~third]  # the tiny model fits its budget whole: one chunk per layer and for the head
    assert set(auto.method) == {"streambp"} and set(auto.seq_len_tokens) == set(plan.timed_lengths)
    assert (auto.partition_size == auto.seq_len_tokens).all()
    assert (auto.head_partition_size == auto.seq_len_tokens).all()
    profiled = frame[frame.metric.str.startswith("kernel_ms_")]
    longest = max(plan.timed_lengths)
    assert set(profiled.seq_len_tokens) == {longest}
    assert set(zip(profiled.method, profiled.head_partition_size, strict=True)) == variants | {
        ("streambp", longest)}
    assert {"kernel_ms_gemm", "kernel_ms_attention_fwd", "kernel_ms_attention_bwd"} <= set(profiled.metric)
    assert (profiled.value >= 0).all() and (profiled[profiled.metric == "kernel_ms_gemm"].value > 0).all()
    assert "sim/measured" in result.output and "/checkpoint" in result.output
    assert "kernel time ms of one step by class" in result.output
    assert "step time ms, median, measured-cpu" in result.output  # every table says how it was obtained
    assert frame[["peak_reserved_gib", "alloc_retries", "num_ooms"]].isna().all().all()  # no CUDA allocator
    assert "alloc retries" not in result.output
    assert set(grads.attn) == {"sdpa"} and set(memory.attn) == {"auto"}
    workspace = frame[frame.metric.isin(["peak_memory_unblocked", "peak_memory_blocked"])]
    assert len(workspace) == 2 * 2 * len(plan.workspace_lengths)  # (unblocked, blocked) x (measured, sim)
    assert set(workspace.source) == {"measured-cpu", "simulated"} and (workspace.status == "ok").all()
    assert set(workspace.seq_len_tokens) == set(plan.workspace_lengths)
    assert set(workspace.method) == {"streambp"}
    assert "kernel workspace: streambp peak GiB" in result.output


def test_gpu_plan_is_chosen_when_cuda_is_present():
    with mock.patch.object(check, "cuda_available", return_value=True):
        plan = check.default_plan()
    assert plan.device == "cuda" and plan.verify_dtype == "bfloat16"
    assert plan.verify_model == "Qwen/Qwen3-0.6B" and plan.memory_model == "Qwen/Qwen3-1.7B"
    # one timed length: the whole plan fits its 8 H200 minutes (32k timed and profiled cost ~1.3 more)
    assert plan.timed_lengths == (16384,) and check.AUTO in plan.timed_head_partitions


def test_flash_kernel_is_checked_only_when_importable():
    with mock.patch("streambp_core.engine.attention.prefix.flash_attn_available", return_value=True):
        assert check.attention_kernels(check.GPU_PLAN) == ("flash", "sdpa")
    with mock.patch("streambp_core.engine.attention.prefix.flash_attn_available", return_value=False):
        assert check.attention_kernels(check.GPU_PLAN) == ("sdpa",)
    assert check.attention_kernels(check.CPU_PLAN) == ("sdpa",)


def _measured_on_a_fake_gpu(setup, device) -> ProbeResult:
    """What `measure_setup` returns on CUDA: the allocator's peak, reserved peak, 2 retries, no OOM."""
    return ProbeResult(seq_len_tokens=setup.spec.seq_len_tokens, status="ok", peak_bytes=GIB // 4,
                       source="measured-cuda", peak_reserved_bytes=GIB // 2, alloc_retries=2,
                       num_ooms=0)  # fmt: skip


def test_memory_rows_carry_the_allocators_reserved_peak_retries_and_ooms():
    plan = dataclasses.replace(check.CPU_PLAN, lengths=(48,))
    with mock.patch.object(check, "measure_setup", _measured_on_a_fake_gpu):
        rows = list(check.memory_rows(plan, check.memory_model(plan), "NVIDIA H200"))
    measured = [r for r in rows if r.source == "measured-cuda"]
    simulated = [r for r in rows if r.source == "simulated"]
    assert len(measured) == len(simulated) == len(check.METHODS)
    assert {(r.alloc_retries, r.num_ooms, r.peak_reserved_gib) for r in measured} == {(2, 0, 0.5)}
    assert {(r.alloc_retries, r.num_ooms, r.peak_reserved_gib) for r in simulated} == {(None, None, None)}
    console = Console(record=True, width=200)
    console.print(selfcheck_report._memory_table(rows_to_frame(rows), "NVIDIA H200"))
    table = console.export_text()
    assert "alloc retries" in table and "OOMs" in table
    cells = [[c.strip() for c in line.split("│")[1:-1]] for line in table.splitlines() if "│" in line]
    assert [row[-3:] for row in cells] == [["0.5", "2", "0"]] * len(check.METHODS)


def test_the_summary_prints_no_empty_table_for_a_skipped_step():
    """Memory rows only (as with --skip-time --skip-profile --skip-verify): the memory table, and no
    step-time or kernel table without rows."""
    plan = dataclasses.replace(check.CPU_PLAN, lengths=(48,))
    with mock.patch.object(check, "measure_setup", _measured_on_a_fake_gpu):
        rows = list(check.memory_rows(plan, check.memory_model(plan), "NVIDIA H200"))
    console = Console(record=True, width=200)
    assert selfcheck_report.print_summary(console, rows_to_frame(rows), "NVIDIA H200") is False
    text = console.export_text()
    assert "peak GiB: simulated vs measured" in text
    assert "step time ms" not in text and "kernel time ms" not in text


class _FakeCudaPeak:
    """A `CudaPeak` whose region saw 2 alloc retries and no OOM; logs when it is entered and left."""

    def __init__(self, log: list[str]) -> None:
        self.log = log

    def __call__(self) -> _FakeCudaPeak:
        return self

    def __enter__(self) -> _FakeCudaPeak:
        self.log.append("enter")
        return self

    def __exit__(self, *exc: object) -> None:
        self.log.append("exit")
        self.num_alloc_retries, self.num_ooms = 2, 0


def test_cuda_timing_counts_retries_over_the_timed_steps_only():
    from streambp_core.step.run import timing as timing_module

    log: list[str] = []
    times = iter([5.0, 6.0, 7.0])

    def event_timed(step):
        step()
        return next(times)

    with (
        mock.patch.object(timing_module, "CudaPeak", _FakeCudaPeak(log)),
        mock.patch.object(timing_module, "_cuda_event_ms", event_timed),
    ):
        timing = timing_module.time_step(lambda: log.append("step"), "cuda", warmup=1, repeats=3)
    assert log == ["step", "enter", "step", "step", "step", "exit"]  # the warm-up is outside the region
    assert (timing.times_ms, timing.alloc_retries, timing.num_ooms) == ((5.0, 6.0, 7.0), 2, 0)


def test_time_rows_record_the_timings_allocator_counters():
    plan = dataclasses.replace(check.CPU_PLAN, lengths=(48,))
    from streambp_core.step.run.timing import Timing

    timing = Timing(times_ms=(3.0, 1.0, 2.0), alloc_retries=2, num_ooms=0)
    with mock.patch.object(check, "timed_step", return_value=timing):
        rows = list(check.time_rows(plan, check.memory_model(plan), "NVIDIA H200"))
    heads = plan.timed_head_partitions
    assert [(r.method, r.head_partition_size, r.step_time_ms, r.alloc_retries, r.num_ooms) for r in rows] == [
        ("checkpoint", plan.head_partition_size, 2.0, 2, 0),
        ("streambp", heads[0], 2.0, 2, 0),
        ("streambp", 48, 2.0, 2, 0),  # AUTO: the whole length fits, one chunk
    ]


def test_a_profiler_that_fails_leaves_an_error_row_not_a_failed_check():
    plan = dataclasses.replace(check.CPU_PLAN, lengths=(48,), timed_head_partitions=(16,))
    with mock.patch.object(check, "profile_kernel_time", side_effect=RuntimeError("CUPTI unavailable\nmore")):
        rows = list(check.profile_rows(plan, check.memory_model(plan), "NVIDIA H200"))
    assert [(r.method, r.metric, r.status, r.error) for r in rows] == [
        ("checkpoint", "kernel_ms_total", "error", "CUPTI unavailable"),
        ("streambp", "kernel_ms_total", "error", "CUPTI unavailable"),
    ]
