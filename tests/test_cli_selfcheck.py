"""`streambp-bench selfcheck`: without CUDA it says so, runs the same code paths on CPU and exits 0."""

from __future__ import annotations

from unittest import mock

import pandas as pd
from typer.testing import CliRunner

from streambp_bench import selfcheck as check
from streambp_bench.cli import app
from streambp_bench.results import ResultsFile


def test_cpu_dry_run_writes_every_kind_of_row(tmp_path):
    result = CliRunner().invoke(app, ["selfcheck", "--out", str(tmp_path)])
    assert result.exit_code == 0, result.output
    assert "No CUDA device" in result.output
    frame = ResultsFile(tmp_path / "selfcheck-cpu-dry-run.csv").load()
    plan = check.CPU_PLAN
    grads = frame[frame.metric == "grad_rel_err"]
    assert set(grads.objective) == set(plan.objectives)
    assert (grads.status == "ok").all()
    assert (grads.value < 1e-4).all()  # float32 on CPU: exact up to rounding
    memory = frame[frame.metric == "peak_memory"]
    assert set(memory.source) == {"measured-cpu", "simulated"}
    assert len(memory) == 2 * len(check.METHODS) * len(plan.lengths)
    pairs = memory.pivot_table(index=["method", "seq_len_tokens"], columns="source", values="value")
    ratio = pairs["simulated"] / pairs["measured-cpu"]
    assert ratio.between(0.9, 1.01).all(), ratio  # the simulator predicts the tracked CPU peak
    times = frame[frame.metric == "step_time"]
    assert set(times.method) == {"checkpoint", "streambp"} and (times.step_time_ms > 0).all()
    assert (times.partition_size == [-(-n // 3) for n in times.seq_len_tokens]).all()
    assert "sim/measured" in result.output and "streambp/checkpoint" in result.output


def test_gpu_plan_is_chosen_when_cuda_is_present():
    with mock.patch.object(check, "cuda_available", return_value=True):
        plan = check.default_plan()
    assert plan.device == "cuda" and plan.verify_dtype == "bfloat16"
    assert plan.verify_model == "Qwen/Qwen3-0.6B" and plan.memory_model == "Qwen/Qwen3-1.7B"


def test_flash_kernel_is_checked_only_when_importable():
    with mock.patch("streambp_core.engine.attention.flash_attn_available", return_value=True):
        assert check.attention_kernels(check.GPU_PLAN) == ("flash", "sdpa")
    with mock.patch("streambp_core.engine.attention.flash_attn_available", return_value=False):
        assert check.attention_kernels(check.GPU_PLAN) == ("sdpa",)
    assert check.attention_kernels(check.CPU_PLAN) == ("sdpa",)


def test_committed_gpu_results_meet_the_checks():
    """The committed H200 run: bf16 rule passed, and the simulator within 3% of the allocator peak."""
    frame = pd.read_csv("results/gpu/selfcheck-h200.csv")
    assert (frame.device_name == "NVIDIA H200").all()
    assert (frame[frame.metric == "grad_rel_err"].status == "ok").all()
    memory = frame[frame.metric == "peak_memory"]
    pairs = memory.pivot_table(index=["method", "seq_len_tokens"], columns="source", values="value")
    assert ((pairs["simulated"] / pairs["measured-cuda"] - 1).abs() <= 0.03).all()
