"""benchmarks/plan_at_scale.py: `plan` at training scale, cold and timed, with the checks its answers are
held to. The committed rows (Qwen3-8B on 8 x H100 at 256k and 1M) passed every check; each check fails on
an answer that breaks it; the script runs end to end on a tiny model."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from tests.cli.errors import benchmark_script

CSV = Path(__file__).resolve().parents[2] / "results" / "benchmarks" / "plan_at_scale.csv"


@pytest.fixture(scope="module")
def script():
    return benchmark_script("plan_at_scale")


def _entry(method: str, sp: int, offload: str, seconds: float, peak: float = 60.0, **more) -> dict:
    return {"recipe": f"{method} sp {sp} {offload}", "method": method, "shard": "zero3", "sp": sp,
            "offload": offload, "head_mode": "recompute", "seq_len_tokens": 1_000_000,
            "estimated_step_time_s": seconds, "simulated_peak_gib": peak, **more}


def _cluster(script, monkeypatch, ranking: list[dict], dominated: list[dict] = ()) -> dict:
    document = {"ranking": ranking, "dominated": list(dominated)}
    monkeypatch.setattr(script, "run_cli", lambda args: (0, document, 1.0, 1.0, ""))
    return script.cluster_row("Qwen/Qwen3-8B", "h100", 8, "1M", 79.65)


def test_the_committed_rows_passed_every_check_and_say_how_each_figure_was_obtained():
    with CSV.open() as handle:
        rows = list(csv.DictReader(handle))
    assert {row["case"] for row in rows} <= {"cluster", "one-gpu"}
    assert any(row["case"] == "cluster" and "--seq-len 1M" in row["command"] for row in rows)
    for row in rows:
        assert row["exit_code"] == "0" and row["failed"] == "", row
        assert (row["time_source"], row["step_time_source"], row["memory_source"]) == (
            "measured-cpu", "estimated", "simulated")
        assert float(row["top_simulated_peak_gib"]) <= float(row["budget_gib"])
    for one in (row for row in rows if row["case"] == "one-gpu"):
        assert one["plan_max_len_tokens"] == one["max_len_tokens"]


def test_a_fastest_recipe_that_fits_and_beats_alst_passes(script, monkeypatch):
    row = _cluster(script, monkeypatch, [_entry("streambp", 8, "none", 500.0), _entry("mst", 8, "none",
    505.0),
                                         _entry("mst", 8, "checkpoints", 506.0)])
    assert row["failed"] == "" and row["alst_estimated_step_s"] == 506.0 and row["recipes_ranked"] == 3


def test_alst_left_out_as_dominated_stands_as_its_recipe_without_the_tier(script, monkeypatch):
    ranking = [_entry("streambp", 8, "none", 500.0), _entry("mst", 8, "none", 505.0),
               _entry("plain", 8, "none", 900.0)]
    row = _cluster(script, monkeypatch, ranking, dominated=[_entry("mst", 8, "checkpoints", 0.0)])
    assert row["failed"] == "" and row["alst_estimated_step_s"] == 505.0


@pytest.mark.parametrize(("ranking", "words"), [
    ([_entry("streambp", 8, "none", 500.0, peak=80.0), _entry("mst", 8, "checkpoints", 506.0),
      _entry("plain", 8, "none", 900.0)], "over the budget"),
    ([_entry("streambp", 8, "none", 500.0), _entry("mst", 8, "checkpoints", 506.0)], "2 recipes ranked"),
    ([_entry("streambp", 8, "none", 500.0), _entry("plain", 8, "none", 501.0),
      _entry("checkpoint", 8, "none", 502.0)], "ALST's recipe is not ranked"),
    ([_entry("streambp", 8, "none", 510.0), _entry("mst", 8, "checkpoints", 506.0),
      _entry("plain", 8, "none", 900.0)], "slower than ALST's"),
])
def test_each_check_names_an_answer_that_breaks_it(script, monkeypatch, ranking, words):
    assert words in _cluster(script, monkeypatch, ranking)["failed"]


def test_one_gpu_fails_where_plans_length_is_not_max_lens(script, monkeypatch):
    plan = {"ranking": [_entry("streambp", 1, "none", 9.0, seq_len_tokens=165_000)], "dominated": []}
    answers = iter([(0, plan, 1.0, 1.0, ""), (0, {"results": [{"max_len_tokens": 165_393}]}, 1.0, 1.0, "")])
    monkeypatch.setattr(script, "run_cli", lambda args: next(answers))
    row = script.one_gpu_row("Qwen/Qwen3-8B", "h100", 79.65)
    assert row["failed"] == "plan's length is not max-len's"
    assert (row["plan_max_len_tokens"], row["max_len_tokens"]) == (165_000, 165_393)


@pytest.mark.slow
def test_the_script_plans_a_tiny_model_cold_and_writes_its_row(script, tmp_path):
    out = tmp_path / "plan.csv"
    code = script.main(["--model", "tiny/qwen3", "--gpus", "2", "--seq-len", "1k", "--budget-gib", "0.05",
                        "--cases", "cluster", "--out", str(out)])
    with out.open() as handle:
        (row,) = list(csv.DictReader(handle))
    assert code == 0 and row["failed"] == "" and int(row["recipes_ranked"]) >= 3
    assert float(row["wall_s"]) > 0 and float(row["cpu_s"]) > 0 and row["time_source"] == "measured-cpu"
