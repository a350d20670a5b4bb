"""benchmarks/published_step_time.py: the committed CSV is what the script computes from its setups (the
published side and every derived column, fast), every row the model is held to lies within the band an
estimate carries and names its source, and the script's row for a setup is our estimate."""

from __future__ import annotations

import csv
from dataclasses import replace
from pathlib import Path

import pytest

from streambp_core.step.estimate.roofline import STEP_BAND, gpu_model
from streambp_core.step.estimate.step_estimate import estimate_step
from tests.cli.errors import benchmark_script

CSV = Path(__file__).resolve().parents[2] / "results" / "benchmarks" / "published_step_time.csv"


@pytest.fixture(scope="module")
def script():
    return benchmark_script("published_step_time")


def test_the_committed_csv_holds_each_setup_and_what_follows_from_its_estimate(script):
    with CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    assert tuple(rows[0]) == script.COLUMNS
    assert [(r["source"], r["setup"]) for r in rows] == [(p.source, p.setup) for p in script.SETUPS]
    for row, published in zip(rows, script.SETUPS, strict=True):
        estimated_s = float(row["estimated_step_s"])
        assert float(row["published_value"]) == published.value
        assert float(row["published_step_s"]) == pytest.approx(published.step_s(), abs=0.01)
        ratio = estimated_s / published.step_s()
        assert float(row["ratio"]) == pytest.approx(ratio, abs=1e-3)
        assert row["in_band"] == str(STEP_BAND[0] <= ratio <= STEP_BAND[1])
        assert row["outside_model"] == published.outside_model
        assert (row["estimated_source"], row["published_source"]) == ("estimated", "published")


def test_every_committed_row_the_model_is_held_to_is_within_25_percent_and_names_its_source():
    with CSV.open(newline="") as handle:
        rows = list(csv.DictReader(handle))
    held = [row for row in rows if not row["outside_model"]]
    assert len(held) >= 5
    assert STEP_BAND == (0.75, 1.25)
    for row in held:
        assert 0.75 <= float(row["ratio"]) <= 1.25, (row["model"], row["seq_len_tokens"], row["ratio"])
        assert row["source"] and row["setup"] and row["attention_kernel"]
        assert row["regime"].endswith("-bound")
    for row in rows:
        assert row["source"].strip(), row
        assert row["in_band"] == "True" or row["outside_model"], (row["model"], row["seq_len_tokens"])


def test_a_row_is_our_estimate_of_the_setup_beside_the_published_figure(script):
    """On a tiny model (fast): the row's estimate is `estimate_step`'s, a throughput becomes the step
    time it implies, and the ratio and band follow."""
    spec = script._spec("tiny/llama", 4_096, "checkpoints").replaced(sp=2, gpus=2)
    published = script.Published("peer", "tiny", spec, "h100", "tokens_per_s_per_gpu", 1_000.0)
    row = script.row_of(published)
    estimated_s = estimate_step(spec, gpu_model("h100")).step_time_ms / 1e3
    assert row["estimated_step_s"] == pytest.approx(estimated_s, abs=0.01)
    assert row["published_step_s"] == pytest.approx(4_096 / (1_000 * 2), abs=0.01)
    assert row["ratio"] == pytest.approx(estimated_s / 2.048, abs=1e-3)
    assert row["in_band"] == (STEP_BAND[0] <= row["ratio"] <= STEP_BAND[1])
    per_step = script.row_of(replace(published, metric="s_per_step", value=3.0))
    assert per_step["published_step_s"] == 3.0
    data_parallel = replace(published, spec=spec.replaced(sp=1))  # two sequences a step over two GPUs
    assert data_parallel.step_s() == pytest.approx(2 * 4_096 / (1_000 * 2))
    one_gpu = replace(published, spec=script._single("tiny/llama", 4_096))  # axolotl's: one GPU, no optimizer
    assert (one_gpu.spec.gpus, one_gpu.spec.sp, one_gpu.spec.optimizer) == (1, 1, "none")
    assert one_gpu.step_s() == pytest.approx(4_096 / 1_000)
