"""The results CSV: schema, round trip, upsert-by-key, atomic writes, clear schema errors, resume."""

from __future__ import annotations

import dataclasses
import os
import signal
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import pytest

from streambp_bench.results import (
    COLUMNS,
    KEY_COLUMNS,
    ResultRow,
    ResultsFile,
    SchemaError,
    csv_io,
    provenance,
    versions,
)
from streambp_bench.results.schema_history import ADDED_COLUMNS, SCHEMA_1_COLUMNS
from streambp_core.config import PROTOCOLS

DEVICE = "simulated A800-SXM4-80GB"
REPO = Path(__file__).resolve().parents[2]


def make_row(seq_len_tokens: int = 4096, method: str = "streambp", **overrides: object) -> ResultRow:
    """A realistic simulated peak-memory row; `overrides` replace any field."""
    fields = {
        "method": method,
        "model": "Qwen/Qwen3-8B",
        "seq_len_tokens": seq_len_tokens,
        "partition_size": 500,
        "head_partition_size": 100,
        "source": "simulated",
        "metric": "peak_memory",
        "value": 32.194,
        "peak_allocated_gib": 32.194,
        "weights_gib": 15.26,
        "grads_gib": 15.26,
        "checkpoints_gib": 1.125,
        "budget_gib": 80.0,
        "device_name": DEVICE,
        "git_sha": "3664e90",
        "timestamp": "2025-06-01T12:00:00+00:00",
    }
    return ResultRow(**{**fields, **overrides})


# --- the row ------------------------------------------------------------------------------------------


def test_columns_hold_the_contract_in_order() -> None:
    required = {"method", "model", "objective", "seq_len_tokens", "batch_size", "partition_size",
                "head_partition_size", "dtype", "lora_rank", "optimizer", "attn", "protocol", "grads",
                "source", "status", "metric", "value", "peak_allocated_gib", "peak_reserved_gib",
                "step_time_ms", "step_time_p20_ms", "step_time_p80_ms", "alloc_retries", "num_ooms",
                "weights_gib", "confirmed_layers", "offload", "host_peak_gib", "to_host_gib", "to_device_gib",
                "gpus", "sp", "shard", "head_mode", "offload_checkpoints", "offload_optimizer",
                "offload_params",
                "grads_gib", "optimizer_gib", "checkpoints_gib", "kv_gib", "logits_gib", "temporaries_gib",
                "kernel_workspace_gib", "budget_gib", "host_budget_gib", "error", "device_name",
                "torch_version", "transformers_version", "package_version", "git_sha",
                "timestamp"}  # fmt: skip
    assert set(COLUMNS) == required
    assert COLUMNS[0] == "method" and COLUMNS[-1] == "timestamp"
    assert set(KEY_COLUMNS) <= set(COLUMNS) and "value" not in KEY_COLUMNS and "timestamp" not in KEY_COLUMNS
    assert {"attn", "protocol", "grads", "offload", "gpus", "sp", "shard", "head_mode"} <= set(KEY_COLUMNS)
    assert "alloc_retries" not in KEY_COLUMNS
    assert "host_peak_gib" not in KEY_COLUMNS
    later = {"attn", "protocol", "grads", "alloc_retries", "num_ooms", *ADDED_COLUMNS}
    assert set(COLUMNS) - set(SCHEMA_1_COLUMNS) == later


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"source": "gpu"}, "source must be one of"),
        ({"status": "crashed"}, "status must be one of"),
        ({"seq_len_tokens": -1}, "seq_len_tokens must be >= 0"),
        ({"partition_size": -500}, "partition_size must be >= 0"),
        ({"peak_allocated_gib": -1.0}, "peak_allocated_gib must be >= 0"),
        ({"step_time_ms": 12.5}, "measured runs only"),
        ({"method": ""}, "method must not be empty"),
        ({"seq_len_tokens": 4096.5}, "integer"),
        ({"attn": "xformers"}, "attn must be one of auto, sdpa, flash"),
        ({"protocol": "paper-ish"}, "protocol must be one of default, paper"),
        ({"grads": "lazy"}, "grads must be one of resident, fresh"),
        ({"alloc_retries": -1}, "alloc_retries must be >= 0"),
        ({"num_ooms": 1.5}, "integer"),
    ],
)
def test_invalid_rows_are_refused(overrides: dict, message: str) -> None:
    with pytest.raises((ValueError, TypeError), match=message):
        make_row(**overrides)


def test_row_is_frozen_and_keyword_only() -> None:
    row = make_row()
    with pytest.raises(dataclasses.FrozenInstanceError):
        row.value = 1.0  # type: ignore[misc]
    with pytest.raises(TypeError):
        ResultRow("streambp", "Qwen/Qwen3-8B")  # type: ignore[misc]


def test_numpy_scalars_and_nan_become_plain_values() -> None:
    row = make_row(seq_len_tokens=np.int64(8192), value=np.float64(1.5), kv_gib=float("nan"))
    assert type(row.seq_len_tokens) is int and type(row.value) is float and row.kv_gib is None
    assert row.to_record()["seq_len_tokens"] == "8192" and row.to_record()["value"] == "1.5"


def test_key_is_the_point_not_the_measurement() -> None:
    row = make_row()
    assert row.key() == make_row(value=99.0, timestamp="2030-01-01T00:00:00+00:00", git_sha="other").key()
    assert row.key() != make_row(seq_len_tokens=8192).key()
    assert row.key() != make_row(metric="step_time", source="measured-cpu").key()
    point = {
        name: getattr(row, name) for name in KEY_COLUMNS if name not in ("objective", "dtype", "batch_size")
    }
    assert ResultRow.key_of(**point) == row.key()  # defaults fill objective, dtype, batch_size
    with pytest.raises(TypeError, match="value"):
        ResultRow.key_of(**point, value=1.0)


@pytest.mark.parametrize(
    "setting", [{"protocol": "paper"}, {"attn": "flash"}, {"grads": "fresh"}, {"offload": "checkpoints"},
                {"gpus": 8, "shard": "zero3"}]
)
def test_rows_differing_only_in_protocol_attn_grads_or_offload_are_different_points(
    tmp_path: Path, setting: dict
) -> None:
    file = ResultsFile(tmp_path / "r.csv")
    file.upsert(make_row(value=30.0))
    file.upsert(make_row(value=40.0, **setting))
    rows = file.rows()
    assert [(row.value, row.key() == make_row().key()) for row in rows] == [(30.0, True), (40.0, False)]
    point = {name: getattr(make_row(**setting), name) for name in KEY_COLUMNS}
    assert ResultRow.key_of(**point) in {row.key() for row in file.rows()}


def test_provenance_fills_versions_sha_and_utc_time() -> None:
    info = provenance("measured-cpu", "AMD EPYC")
    row = make_row(**{**info, "step_time_ms": 10.0})
    assert row.source == "measured-cpu" and row.device_name == "AMD EPYC"
    assert info["torch_version"] not in ("", "unknown") and info["package_version"] not in ("", "unknown")
    assert info["git_sha"]
    stamp = datetime.fromisoformat(info["timestamp"])
    assert stamp.utcoffset() == timezone.utc.utcoffset(None)
    assert abs((datetime.now(timezone.utc) - stamp).total_seconds()) < 60
    with pytest.raises(ValueError, match="source"):
        provenance("gpu", "x")


def test_git_sha_is_unknown_without_git(monkeypatch: pytest.MonkeyPatch) -> None:
    def no_git(*args: object, **kwargs: object) -> None:
        raise FileNotFoundError("git")

    monkeypatch.setattr(versions.subprocess, "run", no_git)
    versions.versions.cache_clear()
    try:
        assert provenance("simulated", DEVICE)["git_sha"] == "unknown"
    finally:
        versions.versions.cache_clear()


# --- the file -----------------------------------------------------------------------------------------


def test_round_trip_keeps_every_value(tmp_path: Path) -> None:
    written = [
        make_row(4096),
        make_row(
            16384, method="plain", status="oom", value=None, partition_size=None, error="CUDA OOM, 2 GiB"
        ),
        make_row(
            2048, source="measured-cpu", metric="step_time", value=905.25, step_time_ms=905.25, lora_rank=32
        ),
    ]
    file = ResultsFile(tmp_path / "r.csv")
    file.append_many(written)
    assert file.rows() == written
    frame = file.load()
    assert list(frame.columns) == list(COLUMNS) and len(frame) == 3
    assert str(frame["seq_len_tokens"].dtype) == "Int64" and frame["value"].dtype == "float64"
    assert frame["partition_size"].isna().tolist() == [False, True, False]
    assert frame.loc[1, "error"] == "CUDA OOM, 2 GiB" and frame.loc[2, "lora_rank"] == 32
    assert (tmp_path / "r.csv").read_text().splitlines()[0] == ",".join(COLUMNS)


def test_upsert_replaces_a_rerun_point_instead_of_duplicating(tmp_path: Path) -> None:
    file = ResultsFile(tmp_path / "r.csv")
    file.upsert(make_row(4096, value=32.0))
    file.upsert(make_row(8192, value=33.0))
    file.upsert(make_row(4096, value=31.5))
    rows = file.rows()
    assert [(row.seq_len_tokens, row.value) for row in rows] == [(4096, 31.5), (8192, 33.0)]
    file.append_many([make_row(8192, value=1.0), make_row(8192, value=2.0), make_row(1024)])
    assert [(row.seq_len_tokens, row.value) for row in file.rows()] == [
        (4096, 31.5),
        (8192, 2.0),
        (1024, 32.194),
    ]


def test_a_hand_written_float_length_is_the_same_point(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path).upsert(make_row(4096))
    path.write_text(path.read_text().replace(",4096,1,500,100,", ",4096.0,1,500.0,100,"))
    file = ResultsFile(path)
    assert {row.key() for row in file.rows()} == {make_row(4096).key()}
    file.upsert(make_row(4096, value=30.0))
    assert [row.value for row in file.rows()] == [30.0]


def _state(directory: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(directory.iterdir())}


@pytest.mark.parametrize("crash", [OSError("disk full"), KeyboardInterrupt()])
def test_a_crash_mid_write_leaves_the_old_file_intact(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, crash: BaseException
) -> None:
    file = ResultsFile(tmp_path / "r.csv")
    file.append_many([make_row(4096), make_row(8192)])
    before = _state(tmp_path)
    temp_files: list[str] = []

    def replace_then_crash(source: str, target: object) -> None:
        temp_files.append(source)
        assert Path(source).parent == tmp_path and len(Path(source).read_text().splitlines()) == 3
        raise crash

    monkeypatch.setattr(csv_io.os, "replace", replace_then_crash)
    with pytest.raises(type(crash)):
        file.upsert(make_row(8192, value=9.5))  # a re-run point: the rewrite path
    assert temp_files and _state(tmp_path) == before  # same bytes, and the temp file is gone
    monkeypatch.undo()
    assert len(ResultsFile(tmp_path / "r.csv").rows()) == 2


WRITER = """
import sys
from streambp_bench.results import ResultRow, ResultsFile
file = ResultsFile(sys.argv[1])
for i in range(1, 100_000):
    file.upsert(ResultRow(method="streambp", model="m", seq_len_tokens=i, source="simulated",
                          metric="peak_memory", value=float(i), device_name="d"))
"""


@pytest.mark.skipif(not hasattr(signal, "SIGKILL"), reason="needs SIGKILL")
def test_kill_9_mid_sweep_loses_no_finished_row(tmp_path: Path) -> None:
    path = tmp_path / "sweep.csv"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    writer = subprocess.Popen([sys.executable, "-c", WRITER, str(path)], env=env, cwd=REPO)
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline and (not path.exists() or path.stat().st_size < 1500):
        time.sleep(0.02)
    writer.send_signal(signal.SIGKILL)
    writer.wait()
    rows = ResultsFile(path).rows()  # parses: never half-written
    assert len(rows) >= 5
    assert [row.seq_len_tokens for row in rows] == list(range(1, len(rows) + 1))


def test_other_schema_is_a_clear_one_line_error(tmp_path: Path) -> None:
    path = tmp_path / "liger.csv"
    path.write_text("kernel_name,metric_name,x_value,y_value_50,gpu_name,method\nrms,speed,1024,0.5,H100,x\n")
    with pytest.raises(SchemaError) as caught:
        ResultsFile(path).load()
    message = str(caught.value)
    assert isinstance(caught.value, ValueError) and "\n" not in message
    assert "liger.csv is not a streambp-bench results CSV" in message
    assert "missing columns: model, objective" in message and "more" in message
    assert "unexpected columns: kernel_name, metric_name, x_value, y_value_50, gpu_name" in message


def _schema_1_file(path: Path, rows: list[ResultRow]) -> None:
    """Write `rows` as the previous schema did: its header, without the five later columns."""
    lines = [",".join(SCHEMA_1_COLUMNS)]
    for row in rows:
        record = row.to_record()
        lines.append(",".join(record[name] for name in SCHEMA_1_COLUMNS))
    path.write_text("\n".join(lines) + "\n")


def test_a_schema_1_file_loads_and_an_upsert_rewrites_it_in_the_current_schema(tmp_path: Path) -> None:
    path = tmp_path / "old.csv"
    _schema_1_file(path, [make_row(4096), make_row(8192, optimizer="adamw", grads="fresh")])
    file = ResultsFile(path)
    rows = file.rows()
    assert [(r.attn, r.protocol, r.grads, r.alloc_retries, r.num_ooms) for r in rows] == [
        ("auto", "default", "resident", None, None),
        ("auto", "default", "fresh", None, None),  # an optimizer step made its gradients
    ]
    assert rows == [make_row(4096), make_row(8192, optimizer="adamw", grads="fresh")]
    assert str(file.load()["alloc_retries"].dtype) == "Int64"
    file.upsert(make_row(4096, value=1.0))  # the same point: replaces the old row
    file.upsert(make_row(4096, protocol="paper", value=2.0))  # a new point
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert [(r.seq_len_tokens, r.protocol, r.value) for r in file.rows()] == [
        (4096, "default", 1.0),
        (8192, "default", 32.194),
        (4096, "paper", 2.0),
    ]


def test_a_file_from_before_the_offload_columns_reads_offload_none_and_empty_host_figures(
    tmp_path: Path,
) -> None:
    path = tmp_path / "before.csv"
    before = [name for name in COLUMNS if name not in ("offload", "host_peak_gib", "to_host_gib",
                                                      "to_device_gib")]
    record = make_row().to_record()
    path.write_text(",".join(before) + "\n" + ",".join(record[name] for name in before) + "\n")
    file = ResultsFile(path)
    [row] = file.rows()
    assert (row.offload, row.host_peak_gib, row.to_host_gib, row.to_device_gib) == ("none", None, None, None)
    assert row.key() == make_row().key()
    file.upsert(make_row(offload="checkpoints", host_peak_gib=3.5, to_host_gib=3.5, to_device_gib=3.5))
    assert path.read_text().splitlines()[0] == ",".join(COLUMNS)
    assert [(r.offload, r.host_peak_gib) for r in file.rows()] == [("none", None), ("checkpoints", 3.5)]


def test_a_file_from_before_the_gpus_and_shard_columns_reads_one_unsharded_gpu(tmp_path: Path) -> None:
    path = tmp_path / "before.csv"
    before = [name for name in COLUMNS if name not in ("gpus", "shard")]
    record = make_row().to_record()
    path.write_text(",".join(before) + "\n" + ",".join(record[name] for name in before) + "\n")
    file = ResultsFile(path)
    [row] = file.rows()
    assert (row.gpus, row.shard) == (1, "none") and row.key() == make_row().key()
    file.upsert(make_row(gpus=4, shard="deepspeed-zero2"))
    assert [(r.gpus, r.shard) for r in file.rows()] == [(1, "none"), (4, "deepspeed-zero2")]
    with pytest.raises(ValueError, match="shard must be one of"):
        make_row(shard="zero1")


def test_committed_results_of_schema_1_still_load() -> None:
    benchmarks = REPO / "results" / "benchmarks"  # the benchmark scripts' CSVs have columns of their own
    paths = sorted(p for p in (REPO / "results").glob("**/*.csv") if benchmarks not in p.parents)
    assert paths
    for path in paths:
        frame = ResultsFile(path).load()
        assert len(frame) and frame["alloc_retries"].isna().all()
        header = path.read_text().splitlines()[0].split(",")
        expected = set(PROTOCOLS) if "protocol" in header else {"default"}  # schema 1 had no protocol
        assert set(frame["protocol"]) <= expected, path
        assert (frame["grads"] == frame["optimizer"].map({"none": "resident", "adamw": "fresh"})).all()


def test_a_header_neither_schema_is_an_error_naming_the_columns(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    header = [name for name in SCHEMA_1_COLUMNS if name != "timestamp"] + ["attn"]
    path.write_text(",".join(header) + "\n")
    missing = "protocol, grads, alloc_retries, num_ooms, timestamp"
    with pytest.raises(SchemaError, match=rf"\(missing columns: {missing}\)$"):
        ResultsFile(path).rows()


def test_one_extra_column_is_named(tmp_path: Path) -> None:
    path = tmp_path / "r.csv"
    ResultsFile(path).upsert(make_row())
    lines = path.read_text().splitlines()
    path.write_text(f"{lines[0]},note\n{lines[1]},hi\n")
    with pytest.raises(SchemaError, match=r"\(unexpected columns: note\)$"):
        ResultsFile(path).rows()
    with pytest.raises(SchemaError, match="unexpected columns: note"):
        ResultsFile(path).upsert(make_row())  # refuses to rewrite a foreign file


def test_empty_file_bad_cell_and_missing_file(tmp_path: Path) -> None:
    (tmp_path / "empty.csv").write_text("")
    with pytest.raises(SchemaError, match="empty"):
        ResultsFile(tmp_path / "empty.csv").load()
    path = tmp_path / "bad.csv"
    ResultsFile(path).append_many([make_row(1), make_row(2)])
    path.write_text(path.read_text().replace(",simulated,", ",gpu-ish,", 1))
    with pytest.raises(SchemaError, match=r"bad\.csv, line 2: source must be one of"):
        ResultsFile(path).rows()
    with pytest.raises(FileNotFoundError):
        ResultsFile(tmp_path / "none.csv").load()
    assert (
        ResultsFile(tmp_path / "none.csv").rows() == []
        and ResultsFile(tmp_path / "none.csv").rows() == []
    )


def test_an_interrupted_sweep_resumes_where_it_stopped(tmp_path: Path) -> None:
    lengths = [1024, 2048, 4096, 8192, 16384, 32768]
    computed: list[int] = []

    def sweep(file: ResultsFile, stop_after: int | None = None) -> None:
        done = {row.key() for row in file.rows()}
        for seq_len in lengths:
            point = {"method": "streambp", "model": "Qwen/Qwen3-8B", "seq_len_tokens": seq_len,
                     "partition_size": 500, "head_partition_size": 100, "source": "simulated",
                     "metric": "peak_memory", "device_name": DEVICE}  # fmt: skip
            if ResultRow.key_of(**point) in done:
                continue
            if stop_after is not None and len(computed) == stop_after:
                raise KeyboardInterrupt  # Ctrl-C before this point finished
            computed.append(seq_len)
            file.upsert(make_row(seq_len, value=30.0 + seq_len / 1e4))

    with pytest.raises(KeyboardInterrupt):
        sweep(ResultsFile(tmp_path / "sweep.csv"), stop_after=3)
    assert len(ResultsFile(tmp_path / "sweep.csv").rows()) == 3
    computed.clear()
    sweep(ResultsFile(tmp_path / "sweep.csv"))  # a fresh process would reopen the file like this
    assert computed == lengths[3:]
    rows = ResultsFile(tmp_path / "sweep.csv").rows()
    assert [row.seq_len_tokens for row in rows] == lengths
    assert len({row.key() for row in rows}) == len(rows)
