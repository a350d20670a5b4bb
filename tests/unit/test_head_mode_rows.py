"""The head_mode results column: a key column, filled from the step (`spec_fields`), read from older CSVs
as the head their rows ran (recompute for streambp, empty for the other methods)."""

from __future__ import annotations

from pathlib import Path

import pytest

from streambp_bench.results import COLUMNS, KEY_COLUMNS, ResultRow, ResultsFile, spec_fields
from streambp_bench.results.schema_history import SCHEMA_1_COLUMNS
from streambp_bench.selfcheck.check import CPU_PLAN, timed_head_mode
from streambp_core.config import StepSpec

TINY = "tiny/qwen3"


def _row(method: str = "streambp", value: float = 1.0, **fields: object) -> ResultRow:
    spec = StepSpec.of(model=TINY, method=method, seq_len_tokens=256, **fields)
    return ResultRow(**spec_fields(spec), source="simulated", metric="peak_memory", value=value,
                     device_name="meta")


def _write_without(path: Path, columns: tuple[str, ...], rows: list[ResultRow]) -> None:
    """`rows` as a file of an older schema wrote them: only `columns`."""
    lines = [",".join(columns), *(",".join(row.to_record()[name] for name in columns) for row in rows)]
    path.write_text("\n".join(lines) + "\n")


@pytest.mark.parametrize(("method", "objective", "asked", "cell"), [
    ("streambp", "sft", "fused", "fused"), ("streambp", "sft", "auto", "fused"),
    ("streambp", "dpo", "auto", "recompute"), ("streambp", "sft", "recompute", "recompute"),
    ("checkpoint", "sft", "fused", ""), ("mst", "grpo", "auto", ""), ("plain", "sft", "recompute", ""),
])
def test_spec_fields_give_streambp_s_resolved_head_and_empty_for_other_methods(method, objective, asked,
                                                                               cell) -> None:
    spec = StepSpec.of(model=TINY, method=method, objective=objective, head_mode=asked)
    assert spec_fields(spec)["head_mode"] == cell
    assert _row(method, objective=objective, head_mode=asked).head_mode == cell


def test_two_rows_differing_only_by_head_mode_coexist_and_round_trip(tmp_path: Path) -> None:
    assert "head_mode" in KEY_COLUMNS and "head_mode" in COLUMNS
    file = ResultsFile(tmp_path / "r.csv")
    recompute, fused = _row(value=1.0, head_mode="recompute"), _row(value=2.0, head_mode="fused")
    file.append_many([recompute, fused, _row("checkpoint", value=3.0)])
    file.upsert(_row(value=4.0, head_mode="fused"))  # the fused point again: replaces its row only
    assert [(r.method, r.head_mode, r.value) for r in file.rows()] == [
        ("streambp", "recompute", 1.0), ("streambp", "fused", 4.0), ("checkpoint", "", 3.0)]
    assert file.rows()[0] == recompute
    assert file.load()["head_mode"].tolist() == ["recompute", "fused", ""]


def test_a_row_names_a_head_streambp_ran_and_no_other_method_has_one() -> None:
    with pytest.raises(ValueError, match="head_mode must be one of fused, recompute, got 'auto'"):
        ResultRow(method="streambp", model=TINY, seq_len_tokens=1, head_mode="auto", source="simulated",
                  metric="peak_memory", device_name="meta")
    with pytest.raises(ValueError, match="a checkpoint row leaves it empty"):
        ResultRow(method="checkpoint", model=TINY, seq_len_tokens=1, head_mode="fused", source="simulated",
                  metric="peak_memory", device_name="meta")
    point = {name: getattr(_row(), name) for name in KEY_COLUMNS}
    assert ResultRow.key_of(**{**point, "head_mode": None}) == _row(head_mode="recompute").key()


@pytest.mark.parametrize("schema", ["before head_mode", "schema 1"])
def test_older_rows_read_as_the_head_they_ran_and_reruns_upsert_onto_them(tmp_path: Path, schema) -> None:
    path = tmp_path / "old.csv"
    columns = SCHEMA_1_COLUMNS if schema == "schema 1" else tuple(c for c in COLUMNS if c != "head_mode")
    _write_without(path, columns, [_row(value=1.0), _row("checkpoint", value=2.0), _row("plain", value=3.0)])
    file = ResultsFile(path)
    assert [(r.method, r.head_mode) for r in file.rows()] == [
        ("streambp", "recompute"), ("checkpoint", ""), ("plain", "")]
    file.append_many([_row(value=10.0), _row("checkpoint", value=20.0), _row("plain", value=30.0),
                      _row(value=40.0, head_mode="fused")])  # re-runs of the same points, and a new one
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert [(r.method, r.head_mode, r.value) for r in file.rows()] == [
        ("streambp", "recompute", 10.0), ("checkpoint", "", 20.0), ("plain", "", 30.0),
        ("streambp", "fused", 40.0)]


def test_selfcheck_s_timed_rows_name_the_fused_head_they_run() -> None:
    assert timed_head_mode(CPU_PLAN, "streambp") == "fused"  # its sft step prepares head_mode="auto"
    assert timed_head_mode(CPU_PLAN, "checkpoint") == ""
