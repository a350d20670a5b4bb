"""`reproduce --check`: a rerun equal to the committed rows passes and writes nothing; a moved, missing or
stale row fails naming its point; the committed data claims (Table 4 against the paper, the GPU
self-check's fits) pass on the committed files and fail on perturbed copies."""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

import pandas as pd
import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.paper import check
from streambp_bench.paper.table4 import section
from streambp_bench.results import ResultRow
from tests.cli.errors import one_line_error

RESULTS = Path(__file__).resolve().parents[2] / "results"


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.iterdir())}


def test_a_rerun_equal_to_the_committed_rows_passes_and_a_moved_one_fails(tmp_path: Path) -> None:
    runner = CliRunner()
    assert runner.invoke(app, ["reproduce", "fig5", "--quick", "--out", str(tmp_path)]).exit_code == 0
    before = _files(tmp_path)
    result = runner.invoke(app, ["reproduce", "fig5", "--quick", "--check", "--out", str(tmp_path), "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["ok"] and [f["check"] for f in document["findings"]] == ["rerun"]
    assert _files(tmp_path) == before  # nothing written, README.md included

    frame = pd.read_csv(tmp_path / "fig5.csv")
    frame.loc[0, "value"] *= 1.1
    frame.to_csv(tmp_path / "fig5.csv", index=False)
    result = runner.invoke(app, ["reproduce", "fig5", "--quick", "--check", "--out", str(tmp_path)])
    assert result.exit_code == 1, result.output
    assert "FAIL fig5 rerun" in result.stdout and "committed" in result.stdout and "1 of 1" in result.stdout


def _row(value: float, **fields) -> ResultRow:
    return ResultRow(method="streambp", model="tiny/llama", seq_len_tokens=0, metric="max_len", value=value,
                     source="simulated", status="ok", device_name="meta", **fields)


def test_compare_names_each_moved_missing_and_stale_row() -> None:
    committed = [_row(1000.0), _row(2000.0, gpus=2, shard="zero2"), _row(3000.0, lora_rank=8)]
    fresh = [_row(1000.0 * (1 + check.RTOL / 10)), _row(2100.0, gpus=2, shard="zero2"),
             _row(5.0, batch_size=2)]
    findings = check.compare("fig3", committed, fresh)
    assert not any(f.ok for f in findings) and len(findings) == 3
    text = [f.detail for f in findings]
    assert any("2 GPUs zero2" in t and "committed 2,000, rerun 2,100" in t for t in text)
    assert any("not in the committed file" in t for t in text)
    assert any("LoRA r8" in t and "no longer produced" in t for t in text)
    oom = dataclasses.replace(committed[0], status="oom")
    assert not check.compare("fig3", [oom], [committed[0]])[0].ok  # a status change alone is a move
    same = check.compare("fig3", committed, committed)
    assert same == [check.Finding("fig3", "rerun", True, "3 rows equal to the committed ones")]


@pytest.mark.skipif(not (RESULTS / "table4.csv").exists(), reason="no committed table4.csv")
def test_table4_agreement_holds_on_the_committed_rows_and_fails_when_they_move() -> None:
    frame = pd.read_csv(RESULTS / "table4.csv")
    assert check.table4_agreement(frame).ok, check.table4_agreement(frame).detail
    text = "\n".join(section(frame))  # the README says so, and names the 3-GPU cell a known difference
    assert "within ±15%" in text and "At 3 GPUs" in text and "known difference" in text
    moved = frame.copy()
    cell = (moved.method == "checkpoint") & (moved.shard == "deepspeed-zero2") & (moved.gpus == 6)
    assert cell.any()
    moved.loc[cell, "value"] *= 1.3
    finding = check.table4_agreement(moved)
    assert not finding.ok and "6 GPUs" in finding.detail
    assert not check.table4_agreement(frame[frame.gpus != 8]).ok  # a missing cell is no pass


@pytest.mark.skipif(not (RESULTS / "gpu").is_dir(), reason="no committed GPU results")
def test_the_committed_gpu_rows_fit_and_a_perturbed_copy_does_not(tmp_path: Path) -> None:
    paths = sorted((RESULTS / "gpu").glob("selfcheck-*.csv"))
    assert paths
    for path in paths:
        assert check.gpu_fit(path).ok, check.gpu_fit(path).detail
    frame = pd.read_csv(paths[0])
    simulated = (frame.metric == "peak_memory") & (frame.source == "simulated")
    frame.loc[simulated.idxmax(), "value"] *= 1.05
    frame.to_csv(tmp_path / "selfcheck-x.csv", index=False)
    assert "outside" in check.gpu_fit(tmp_path / "selfcheck-x.csv").detail
    frame = pd.read_csv(paths[0])
    frame.loc[(frame.metric == "grad_rel_err").idxmax(), "status"] = "error"
    frame.to_csv(tmp_path / "selfcheck-y.csv", index=False)
    assert not check.gpu_fit(tmp_path / "selfcheck-y.csv").ok


def test_measured_items_are_read_not_rerun(tmp_path: Path) -> None:
    finding, = check.measured("table6", RESULTS)
    assert finding.ok and "not measured again" in finding.detail
    assert not check.measured("table6", tmp_path)[0].ok  # no file


def test_check_of_a_missing_folder_is_one_error_line(tmp_path: Path) -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--check", "--out", str(tmp_path / "nope")])
    one_line_error(result, "--check", "not a folder")
    assert not (tmp_path / "nope").exists()


def test_a_duplicate_row_before_the_true_one_fails() -> None:
    """The later row won the key's dict entry, so a wrong row inserted before the true one passed."""
    true = _row(1.0)
    findings = check.compare("fig5", [_row(2.0), true], [true])
    assert [f.ok for f in findings] == [False] and "2 committed rows of one point" in findings[0].detail


def test_a_measured_row_in_a_simulated_item_fails() -> None:
    true = _row(1.0)
    forged = dataclasses.replace(_row(0.5), source="measured-cuda", device_name="NVIDIA H100")
    findings = check.compare("fig5", [true, forged], [true])
    assert not findings[0].ok and "measured-cuda row in a simulated item" in findings[0].detail


def test_measured_rows_need_their_provenance_and_one_row_per_point(tmp_path: Path) -> None:
    frame = pd.read_csv(RESULTS / "table6.csv")
    frame.loc[0, "torch_version"] = "unknown"
    frame.to_csv(tmp_path / "table6.csv", index=False)
    finding, = check.measured("table6", tmp_path)
    assert not finding.ok and "without torch_version" in finding.detail
    frame = pd.read_csv(RESULTS / "table6.csv")
    pd.concat([frame.iloc[[0]].assign(value=9.0), frame]).to_csv(tmp_path / "table6.csv", index=False)
    finding, = check.measured("table6", tmp_path)
    assert not finding.ok and "2 rows of one point" in finding.detail


def test_a_forged_gpu_row_fails_without_a_cuda_torch_or_a_simulated_twin(tmp_path: Path) -> None:
    frame = pd.read_csv(RESULTS / "gpu" / "selfcheck-h200.csv")
    measured = frame[(frame.metric == "peak_memory") & (frame.source == "measured-cuda")].iloc[[0]]
    pd.concat([frame, measured.assign(seq_len_tokens=12345)]).to_csv(tmp_path / "a.csv", index=False)
    assert "without a simulated twin" in check.gpu_fit(tmp_path / "a.csv").detail
    pd.concat([frame, measured.assign(seq_len_tokens=12345, torch_version="2.13.0+cpu")]).to_csv(
        tmp_path / "b.csv", index=False)
    assert "CPU build of torch" in check.gpu_fit(tmp_path / "b.csv").detail


@pytest.mark.parametrize("text", ["", "a,b\n1,2\n"])
def test_an_empty_or_foreign_gpu_file_is_a_finding_not_a_traceback(tmp_path: Path, text: str) -> None:
    (tmp_path / "gpu").mkdir()
    (tmp_path / "gpu" / "selfcheck-x.csv").write_text(text)
    finding, = check.data_checks("table1", tmp_path)
    assert not finding.ok and "gpu/selfcheck-x.csv" in finding.detail


def test_check_quick_against_the_committed_results_is_refused() -> None:
    result = CliRunner().invoke(app, ["reproduce", "fig5", "--check", "--quick", "--out", str(RESULTS)])
    one_line_error(result, "--check --quick", "leave --quick out")


@pytest.mark.parametrize("spelling", ["absolute", "relative"])
def test_quick_never_writes_into_the_checkout_s_results(tmp_path: Path, monkeypatch, spelling: str) -> None:
    """From a subfolder, ../results is the checkout's results/ too, as is its absolute path."""
    before = {path: path.stat().st_mtime_ns for path in RESULTS.rglob("*")}
    monkeypatch.chdir(RESULTS.parent / "docs")
    out = str(RESULTS) if spelling == "absolute" else "../results"
    result = CliRunner().invoke(app, ["reproduce", "table6", "--quick", "--out", out])
    one_line_error(result, "--quick", "the checkout's results/")
    assert {path: path.stat().st_mtime_ns for path in RESULTS.rglob("*")} == before
