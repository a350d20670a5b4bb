"""The self-check's plan: its items in order with their H200 estimates within the budget, rows written as
made, a failed item a failed row and the plan going on, the dry run, and the CUDA figures read from the
allocator (torch.cuda stood in for: no GPU here)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultRow, ResultsFile, provenance
from streambp_bench.selfcheck import check, estimate, items, owed, plan


def _row(name: str, index: int) -> ResultRow:
    return ResultRow(method="streambp", model=name, seq_len_tokens=index + 2, metric="peak_memory", value=1.0,
                     **provenance("simulated", "d"))


def _item(name: str, rows: int, fails: bool = False) -> plan.Item:
    def run(context):
        for index in range(rows):
            yield _row(name, index)
        if fails:
            raise RuntimeError(f"{name} broke\nsecond line")

    return plan.Item(name, "a test item", run, lambda context: 60.0)


def test_the_plans_items_are_the_names_options_take_in_order() -> None:
    assert [item.name for item in items.plan_items(check.GPU_PLAN)] == list(plan.ITEM_NAMES)


def test_the_plan_fits_the_budget_from_the_committed_rows() -> None:
    context = items.Context(check.GPU_PLAN, "plan")
    estimates = {item.name: item.estimate_s(context) for item in items.plan_items(check.GPU_PLAN)}
    assert all(seconds > 0 for seconds in estimates.values())
    assert sum(estimates.values()) / 60 <= estimate.BUDGET_MINUTES
    curves = estimate.fitted_curves()  # fitted through the committed 8k and 16k step times
    assert curves["checkpoint"].ms(16384) == pytest.approx(863.0363, rel=1e-4)
    assert curves["streambp"].ms(8192) == pytest.approx(638.976, rel=1e-4)
    assert estimates["offload-256k"] == max(estimates.values())  # the longest steps of the plan


def test_rows_are_written_as_made_and_a_failed_item_is_a_row_and_the_plan_goes_on() -> None:
    written: list[ResultRow] = []
    ended: list[tuple[str, int]] = []
    ticks = iter(range(100))
    runner = plan.Runner(written.append, "cuda", "NVIDIA H200", clock=lambda: 30.0 * next(ticks),
                         on_item=lambda outcome: ended.append((outcome.name, len(written))))
    outcomes = runner.run([_item("a", 2), _item("b", 1, fails=True), _item("c", 1)], context=None)
    assert [(row.model, row.metric) for row in written] == [
        ("a", "peak_memory"), ("a", "peak_memory"), ("a", plan.ITEM_METRIC), ("b", "peak_memory"),
        ("b", plan.ITEM_METRIC), ("c", "peak_memory"), ("c", plan.ITEM_METRIC)]
    assert ended == [("a", 3), ("b", 5), ("c", 7)]  # each item's rows were out before the next began
    failed = written[4]
    assert failed.status == "error" and failed.error == "RuntimeError: b broke second line"
    assert failed.source == "measured-cuda" and failed.value == pytest.approx(0.5)  # 30 s, wall clock
    assert [outcome.error for outcome in outcomes] == ["", "RuntimeError: b broke second line", ""]


def test_ctrl_c_stops_the_plan() -> None:
    def interrupted(context):
        raise KeyboardInterrupt
        yield

    runner = plan.Runner(lambda row: None, "cpu", "cpu")
    with pytest.raises(KeyboardInterrupt):
        runner.run([plan.Item("x", "x", interrupted, lambda context: 1.0), _item("y", 1)], None)
    assert runner.outcomes == []


def test_the_dry_run_checks_order_rows_failures_and_budget(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["selfcheck", "--dry-run", "--out", str(tmp_path), "--fail", "memory",
                                      "--fail", "offload-256k"])
    assert result.exit_code == 0, result.output
    assert result.output.count("ok ") >= 4 and "problem" not in result.output
    rows = ResultsFile(tmp_path / "selfcheck-plan-dry-run.csv").rows()
    ended = [row for row in rows if row.metric == plan.ITEM_METRIC]
    assert [row.model for row in ended] == list(plan.ITEM_NAMES)
    assert {row.model for row in ended if row.status == "error"} == {"memory", "offload-256k"}
    planned = [row for row in rows if row.metric == plan.PLANNED_METRIC]
    assert {row.source for row in planned} == {"estimated"} and len(planned) == len(plan.ITEM_NAMES) - 2


def test_the_dry_run_finds_a_plan_over_budget_and_rows_out_of_order() -> None:
    plan_items = [_item("a", 1), _item("b", 1)]
    outcomes = [plan.Outcome("a", 1, 0.0, 60.0), plan.Outcome("b", 1, 0.0, 60.0)]
    rows = [_row("b", 0), plan.item_row("b", 0.0, "", "cpu", "d"), _row("a", 0),
            plan.item_row("a", 0.0, "", "cpu", "d")]
    problems = plan.check_dry_run(plan_items, None, outcomes, rows, fail=(), budget_minutes=1.5)
    assert any("over the 1.5-minute budget" in problem for problem in problems)
    assert any("ended in the order ['b', 'a']" in problem for problem in problems)


def test_plan_lists_every_item_with_its_estimate_and_the_total() -> None:
    result = CliRunner().invoke(app, ["selfcheck", "--plan", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.output)
    assert [entry["item"] for entry in document["items"]] == list(plan.ITEM_NAMES)
    assert document["source"] == "estimated" and "selfcheck-h200.csv" in document["basis"]
    total = sum(entry["estimated_minutes"] for entry in document["items"])
    assert document["total_minutes"] == pytest.approx(total, abs=0.02) and total <= 8.0


class _FakePeak:
    """What `CudaPeak` reads from torch.cuda, fixed: allocated, reserved, retries, OOMs, pinned peak."""

    def __init__(self) -> None:
        self.peak_allocated_bytes, self.peak_reserved_bytes = 3 * 2**30, 4 * 2**30
        self.num_alloc_retries, self.num_ooms, self.peak_pinned_bytes = 1, 0, 2**30

    def __enter__(self):
        return self

    def __exit__(self, *exc_info) -> None:
        pass


class _FakeEvent:
    def __init__(self, enable_timing: bool) -> None:
        assert enable_timing

    def record(self) -> None:
        pass

    def synchronize(self) -> None:
        pass

    def elapsed_time(self, end) -> float:
        return 1234.5


def test_a_cuda_step_reads_the_allocators_and_the_pinned_peak(monkeypatch: pytest.MonkeyPatch) -> None:
    import torch

    import streambp_core.measure.cuda as cuda_module

    monkeypatch.setattr(cuda_module, "CudaPeak", _FakePeak)
    monkeypatch.setattr(torch.cuda, "Event", _FakeEvent)
    calls: list[int] = []
    probe, step_ms = owed._peak_of(lambda: calls.append(1), "cuda", 65536)
    assert calls == [1] and step_ms == 1234.5
    assert probe.source == "measured-cuda"
    assert (probe.peak_bytes, probe.peak_reserved_bytes) == (3 * 2**30, 4 * 2**30)
    assert (probe.alloc_retries, probe.num_ooms, probe.host_peak_bytes) == (1, 0, 2**30)
    spec = owed.offload_specs("Qwen/Qwen3-1.7B", "bfloat16", 65536)[1]
    row = owed.peak_row(spec, probe, "NVIDIA H200", step_ms)
    assert (row.value, row.host_peak_gib, row.peak_reserved_gib, row.step_time_ms) == (3.0, 1.0, 4.0, 1234.5)
    assert row.offload == "checkpoints" and row.source == "measured-cuda"


def test_the_owed_rows_run_on_a_cpu_with_a_tiny_model() -> None:
    """Offload with and without, and the host tiers, on CPU: the same code a GPU runs, wall-clock time."""
    import torch

    from streambp_core.models.load import build_model
    from streambp_core.step.parts.resolved import ResolvedModel

    model = ResolvedModel("tiny/qwen3")
    network = build_model("tiny/qwen3", dtype=torch.float32, device="cpu", seed=0)
    specs = owed.offload_specs("tiny/qwen3", "float32", 96)
    rows = list(owed.offload_rows(specs, network, model, "cpu", "cpu", warmup=1))
    assert [(row.offload, row.metric, row.source) for row in rows] == [
        (offload, "peak_memory", source) for offload in ("none", "checkpoints")
        for source in ("measured-cpu", "simulated")]
    assert all(row.status == "ok" for row in rows) and rows[0].step_time_ms > 0
    simulated = [row for row in rows if row.source == "simulated"]
    assert simulated[1].host_peak_gib > 0 and simulated[1].value < simulated[0].value  # host holds them
    tiers = list(owed.tier_rows(owed.tier_specs("tiny/qwen3", "float32", 96), model, "cpu", "cpu"))
    assert [(row.offload, row.source) for row in tiers] == [
        ("optimizer", "measured-cpu"), ("optimizer", "simulated"), ("optimizer,params", "measured-cpu"),
        ("optimizer,params", "simulated")]
    assert all(row.status == "ok" for row in tiers) and tiers[1].host_peak_gib > 0


def test_max_len_rows_put_the_measured_search_beside_the_simulated_one(monkeypatch) -> None:
    from types import SimpleNamespace

    import streambp_core.step.search.probe as probe_module

    answers = {"cuda": SimpleNamespace(max_len_tokens=21_000, capped=False),
               "sim": SimpleNamespace(max_len_tokens=10_000_000, capped=True)}
    monkeypatch.setattr(probe_module, "max_len", lambda spec, budget, device, model: answers[device])
    spec = owed.fsdp_spec("tiny/qwen3", "float32", 64).replaced(optimizer="none", gpus=1, shard="none")
    measured, simulated = owed.max_len_rows(spec, 6.0, "NVIDIA H200", "cuda")
    assert (measured.source, measured.metric, measured.value, measured.budget_gib) == (
        "measured-cuda", "max_len", 21_000.0, 6.0)
    assert measured.seq_len_tokens == 0 and measured.status == "ok"
    assert simulated.source == "simulated" and simulated.status == "error" and simulated.value is None
    assert "capped" in simulated.error  # a capped search is no max length


@pytest.mark.parametrize(("args", "message"), [
    (["--plan", "--dry-run"], "give one of them"),
    (["--dry-run", "--skip", "fsdp", "--fail", "fsdp"], "that item is skipped"),
    (["--fail", "time"], "give it with --dry-run"),
    (["--skip", "nope"], "unknown item nope"),
])
def test_selfcheck_options_that_contradict_are_one_line_errors(args: list[str], message: str) -> None:
    result = CliRunner().invoke(app, ["selfcheck", *args])
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_dry_run_without_the_default_failing_item_fails_another() -> None:
    result = CliRunner().invoke(app, ["selfcheck", "--dry-run", "--skip", "fsdp", "--skip", "verify"])
    assert result.exit_code == 0, result.output
    assert "failed stand-in (families)" in result.output and "fsdp" not in result.output


def test_the_estimate_without_the_committed_rows_is_a_one_line_error(tmp_path: Path) -> None:
    from streambp_core.config import ConfigError

    with pytest.raises(ConfigError, match="the plan's estimates are fitted to"):
        estimate.fitted_curves(tmp_path / "missing.csv")
    partial = tmp_path / "rows.csv"
    partial.write_text("method,model,seq_len_tokens,metric,value\ncheckpoint,Qwen/Qwen3-1.7B,8192,step_time,1\n")
    with pytest.raises(ConfigError, match="no checkpoint step_time row at 16384 tokens"):
        estimate.fitted_curves(partial)


def test_the_summary_pairs_the_owed_rows_and_keeps_them_out_of_the_memory_table() -> None:
    from rich.console import Console

    from streambp_bench.results import rows_to_frame
    from streambp_bench.selfcheck import report
    from streambp_core.search import ProbeResult

    def probe(gib: float, source: str, host: float | None = None) -> ProbeResult:
        return ProbeResult(seq_len_tokens=65536, status="ok", peak_bytes=int(gib * 2**30), source=source,
                           host_peak_bytes=None if host is None else int(host * 2**30))

    resident, offloaded = owed.offload_specs("Qwen/Qwen3-1.7B", "bfloat16", 65536)
    sharded = owed.fsdp_spec("Qwen/Qwen3-1.7B", "bfloat16", 65536)
    memory = check.memory_spec(check.GPU_PLAN, "streambp", 65536)
    rows = [owed.peak_row(resident, probe(20.0, "measured-cuda"), "H200", 1000.0),
            owed.peak_row(resident, probe(19.8, "simulated"), "H200"),
            owed.peak_row(offloaded, probe(10.0, "measured-cuda", host=8.0), "H200", 1100.0),
            owed.peak_row(offloaded, probe(9.9, "simulated", host=7.5), "H200"),
            owed.peak_row(sharded, probe(30.0, "measured-cuda"), "H200", 900.0),
            owed.peak_row(memory, probe(12.0, "measured-cuda"), "H200"),
            owed.peak_row(memory, probe(11.9, "simulated"), "H200")]
    console = Console(record=True, width=250)
    report.print_summary(console, rows_to_frame(rows), "H200")
    text = console.export_text()
    memory_table, owed_table = text.split("offload, FSDP2 and host tiers")
    assert memory_table.count("65536") == 1 and "0.992" in memory_table  # the memory step's row alone
    assert "1.100" in owed_table and "0.990" in owed_table  # offloaded vs resident time, sim/measured
    assert "zero3" in owed_table and "7.5" in owed_table and "8" in owed_table


def test_the_cpu_check_keeps_only_a_failed_items_row() -> None:
    written: list[ResultRow] = []
    runner = plan.Runner(written.append, "cpu", "cpu", minutes_rows=False)
    runner.run([_item("a", 1), _item("b", 0, fails=True)], context=None)
    assert [(row.model, row.metric, row.status) for row in written] == [
        ("a", "peak_memory", "ok"), ("b", plan.ITEM_METRIC, "error")]
