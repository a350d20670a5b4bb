"""Inputs at the edges a newcomer reaches first, each answered in one line or exactly: counts that would hang
or eat memory, outputs that are no regular file or a full disk, Ctrl-C at start-up, options that would be
silently ignored, JSON without NaN, and searches where nothing fits."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.output import emit
from streambp_bench.results import csv_io
from tests.cli.errors import one_line_error

TINY_SIM = ["-m", "tiny/qwen3", "--method", "streambp", "--dtype", "float32", "--device", "sim"]


def test_a_huge_packing_count_is_refused_at_once_in_max_len_and_sweep() -> None:
    result = CliRunner().invoke(app, ["max-len", *TINY_SIM, "--budget-gib", "0.02",
                                      "--packing", "1000000000"])
    one_line_error(result, "--packing", "1,000,000,000 documents", "100,000,000 tokens")
    result = CliRunner().invoke(app, ["sweep", *TINY_SIM, "--seq-len", "1k", "--packing", "2k"])
    one_line_error(result, "--packing", "2,000 documents", "1,000 tokens")


def test_packing_takes_k_suffixes(stub_probe) -> None:
    result = CliRunner().invoke(app, ["max-len", *TINY_SIM, "--budget-gib", "0.02", "--packing", "0.01k",
                                      "--json"])
    assert result.exit_code == 0, result.output
    (note,) = json.loads(result.stdout)["packing"]
    assert len(note["documents"][0]) == 10


@pytest.mark.parametrize("device", ["/dev/zero", "/dev/full"])
def test_an_out_that_is_no_regular_file_is_refused(tmp_path: Path, device: str) -> None:
    out = tmp_path / "results.csv"
    out.symlink_to(device)
    for command in (["max-len", *TINY_SIM, "--budget-gib", "0.02"], ["sweep", *TINY_SIM, "--seq-len", "1k"]):
        result = CliRunner().invoke(app, [*command, "--out", str(out)])
        one_line_error(result, str(out), device, "not a regular file")


def test_a_full_disk_is_one_error_line_and_keeps_the_rows(tmp_path: Path, monkeypatch) -> None:
    out = tmp_path / "sweep.csv"
    args = ["sweep", *TINY_SIM, "--budget-gib", "1", "--out", str(out)]
    assert CliRunner().invoke(app, [*args, "--seq-len", "1k"]).exit_code == 0
    before = out.read_bytes()

    def full(descriptor: int, data: bytes) -> int:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(csv_io.os, "write", full)
    result = CliRunner().invoke(app, [*args, "--seq-len", "2k"])
    line = result.stderr.strip().splitlines()[-1]  # after the progress bar CliRunner keeps
    assert result.exit_code == 2 and "Traceback" not in result.output, result.output
    assert line == f"error: {out}: cannot write results: No space left on device"
    assert out.read_bytes() == before


def _interrupted_at(delay_s: float) -> tuple[int, list[str], str]:
    # SIGINT as a terminal's foreground job has it (a background job, as under some CI runners, ignores it)
    start = ("import signal; signal.signal(signal.SIGINT, signal.default_int_handler)\n"
             "from streambp_bench.cli import run; run()")
    command = [sys.executable, "-c", start, "max-len",
               "-m", "tiny/qwen3", "--device", "sim", "--budget-gib", "0.02", "--jobs", "2"]
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True)  # its own process group, as a terminal's job
    time.sleep(delay_s)
    os.killpg(process.pid, signal.SIGINT)  # what Ctrl-C sends: every process of the group
    _, stderr = process.communicate(timeout=60)
    time.sleep(0.3)  # a child's traceback would arrive after its parent exits
    return process.returncode, stderr.strip().splitlines(), stderr


@pytest.mark.parametrize("delay_s", [0.2, 0.7, pytest.param(1.5, marks=pytest.mark.slow),
                                     pytest.param(3.0, marks=pytest.mark.slow)])
def test_ctrl_c_during_start_up_is_one_line_and_exit_130(delay_s: float) -> None:
    """Wherever it lands: interpreter start, imports, the fork server's start, its workers, the search."""
    code, lines, stderr = _interrupted_at(delay_s)
    assert (code, lines) == (130, ["error: interrupted"]), stderr


def test_offload_with_the_default_method_all_leaves_plain_out_and_a_named_plain_is_refused(
        stub_probe) -> None:
    args = ["max-len", "-m", "tiny/qwen3", "--dtype", "float32", "--device", "sim", "--budget-gib", "0.02",
            "--offload", "checkpoints"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    methods = [entry["method"] for entry in json.loads(result.stdout)["results"]]
    assert sorted(methods) == ["checkpoint", "mst", "streambp"]
    one_line_error(CliRunner().invoke(app, [*args, "--method", "plain"]), "plain", "nothing to offload")


VERIFY_SFT = ["verify", "trainer", "sft", "-m", "tiny/llama", "--dtype", "float64", "-T", "64"]


@pytest.mark.parametrize(("extra", "words"), [
    (["--sp", "2", "--nproc", "2"], ("No such option: --sp",)),
    (["--packing", "3"], ("No such option: --packing",)),
    (["--set", "learning_rate=nan"], ("learning_rate=nan", "finite")),
    (["--set", "learning_rate=Infinity"], ("learning_rate=Infinity", "finite")),
    (["--set", "gradient_accumulation_steps=0"], ("accumulation_steps", "at least 1")),
    (["--set", "per_device_train_batch_size=0"], ("per_device_train_batch_size",)),
    (["--set", "learning_rate=fast"], ("learning_rate must be a number",)),
])
def test_verify_trainer_refuses_what_it_would_ignore_or_cannot_train(extra: list[str], words: tuple[str, ...]
                                                                     ) -> None:
    one_line_error(CliRunner().invoke(app, [*VERIFY_SFT, *extra]), *words)


def test_json_output_is_valid_json_without_nan(capsys: pytest.CaptureFixture[str]) -> None:
    emit({"error": float("nan"), "rows": [{"x": float("inf"), "y": 1.5}], "pair": (float("-inf"), 2)},
         True, lambda console: None)
    text = capsys.readouterr().out
    assert json.loads(text, parse_constant=lambda name: pytest.fail(f"bare {name}")) == {
        "error": None, "rows": [{"x": None, "y": 1.5}], "pair": [None, 2]}


@pytest.mark.parametrize(("extra", "words"), [
    (["--gpus", "4", "--sp", "2", "--shard", "deepspeed-zero2"], ("sp 2 with shard deepspeed-zero2",
                                                                   "does not run under DeepSpeed")),
    (["--gpus", "2", "--sp", "2", "--packing", "3"], ("--packing with sequence parallelism",)),
    (["--objective", "dpo", "-b", "2", "--packing", "3"], ("packed rows train the sft objective, not dpo",)),
])
def test_max_len_refuses_what_verify_refuses(extra: list[str], words: tuple[str, ...]) -> None:
    one_line_error(CliRunner().invoke(app, ["max-len", *TINY_SIM, "--budget-gib", "0.02", *extra]), *words)


def test_max_len_where_nothing_fits_says_so_and_writes_nothing(tmp_path: Path, stub_probe) -> None:
    stub_probe.bytes_per_token = dict.fromkeys(stub_probe.bytes_per_token, 2**30)  # 2 GiB at 2 tokens
    out = tmp_path / "max_len.csv"
    args = ["max-len", "-m", "tiny/qwen3", "--device", "sim", "--gpus", "2", "--shard", "deepspeed-zero2",
            "--budget-gib", "0.001", "--out", str(out)]
    one_line_error(CliRunner().invoke(app, args), "nothing fits in 0.001 GiB", "at 2 tokens, simulated")
    assert not out.exists()


def test_a_method_that_fits_nothing_beside_one_that_does_prints_none_not_zero() -> None:
    from streambp_bench.maxlen.report import max_len_cell
    from streambp_core.search import SearchResult

    def search(tokens: int, fails: int | None) -> SearchResult:
        return SearchResult(max_len_tokens=tokens, peak_at_max=None, bracket=(tokens, fails), probes=[],
                            budget_bytes=1)

    assert [max_len_cell(search(0, 2)), max_len_cell(search(4096, 4200)), max_len_cell(search(8, None))] == [
        "none", "4,096", "≥ 8"]
