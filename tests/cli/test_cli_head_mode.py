"""`--head-mode` on max-len, sweep and verify: it reaches the step, the rows and the output; a head the
objective cannot take is one `error:` line before torch is imported."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.results import ResultsFile
from streambp_core.models import load_config
from tests.cli.errors import one_line_error

REPO = Path(__file__).resolve().parents[2]
TINY = "tiny/qwen3"
SWEEP = ["sweep", "-m", TINY, "--method", "checkpoint,streambp", "--seq-len", "256", "--ps", "32",
         "--ps-head", "32", "--device", "sim", "--budget-gib", "1"]
"""32-token chunks: the step peaks where the fused head's buffer is alive (with 64-token chunks the attention
backward's kernel workspace puts the tiny model's peak in a layer's backward, after the head's)."""
DPO_FUSED = {
    "max-len": ["max-len", "-m", TINY, "--device", "sim"],
    "sweep": ["sweep", "-m", TINY, "--device", "sim"],
    "verify": ["verify", "-m", TINY, "-b", "2"],
}


def test_sweep_rows_of_the_two_heads_are_two_points_with_their_own_peaks(tmp_path: Path) -> None:
    """Resident grads: the fused head holds one vocab x hidden (+ final norm) gradient buffer more."""
    out = tmp_path / "sweep.csv"
    for head in ("recompute", "fused"):
        result = CliRunner().invoke(app, [*SWEEP, "--head-mode", head, "--out", str(out), "--json"])
        assert result.exit_code == 0, result.output
        assert json.loads(result.stdout)["head_mode"] == head
    rows = {(r.method, r.head_mode): r for r in ResultsFile(out).rows()}
    assert sorted(rows) == [("checkpoint", ""), ("streambp", "fused"), ("streambp", "recompute")]
    fused, recompute = rows["streambp", "fused"], rows["streambp", "recompute"]
    assert fused.peak_allocated_gib != recompute.peak_allocated_gib
    config = load_config(TINY)
    buffer_bytes = (config.vocab_size * config.hidden_size + config.hidden_size) * 2  # bfloat16
    assert (fused.grads_gib - recompute.grads_gib) * 2**30 == pytest.approx(buffer_bytes)
    again = CliRunner().invoke(app, [*SWEEP, "--head-mode", "fused", "--out", str(out), "--json"])
    assert json.loads(again.stdout)["skipped"] == 2  # the checkpoint row and the fused row: resumed


@pytest.mark.slow
def test_max_len_names_the_head_in_the_json_the_step_line_and_the_rows(tmp_path: Path) -> None:
    args = ["max-len", "-m", TINY, "--method", "checkpoint,streambp", "--device", "sim", "--budget-gib",
            "0.002", "--ps", "64", "--ps-head", "32", "--head-mode", "auto", "--jobs", "1"]
    result = CliRunner().invoke(app, [*args, "--json", "--out", str(tmp_path / "m.csv")])
    assert result.exit_code == 0, result.output
    heads = {r["method"]: r["head_mode"] for r in json.loads(result.stdout)["results"]}
    assert heads == {"checkpoint": None, "streambp": "fused"}  # auto: fused for sft
    assert {(r.method, r.head_mode) for r in ResultsFile(tmp_path / "m.csv").rows()} == {
        ("checkpoint", ""), ("streambp", "fused")}
    table = CliRunner().invoke(app, args)
    assert "LM head fused (streambp)" in table.stdout


@pytest.mark.parametrize("command", sorted(DPO_FUSED))
def test_a_fused_head_for_dpo_is_one_line(command: str) -> None:
    result = CliRunner().invoke(app, [*DPO_FUSED[command], "--objective", "dpo", "--head-mode", "fused"])
    one_line_error(result, "head_mode fused", "dpo")


def test_the_refusal_comes_before_torch_is_imported() -> None:
    calls = [[*args, "--objective", "dpo", "--head-mode", "fused"] for args in DPO_FUSED.values()]
    code = (
        "import json, sys\nfrom streambp_bench.cli import main\ncodes = []\n"
        f"for argv in {calls!r}:\n"
        "    sys.argv = ['streambp-bench', *argv]\n"
        "    try:\n        main()\n    except SystemExit as done:\n        codes.append(done.code)\n"
        "print(json.dumps([codes, 'torch' in sys.modules]))\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO,
                          env={"PYTHONPATH": str(REPO), "PATH": "/usr/bin:/bin"}, check=True)
    assert json.loads(done.stdout.splitlines()[-1]) == [[2, 2, 2], False]
    assert done.stderr.count("error: head_mode fused") == 3


def test_verify_checks_the_fused_head_and_says_so() -> None:
    args = ["verify", "-m", TINY, "--seq-len", "24", "--ps", "7", "--ps-head", "5", "--dtype", "float64",
            "--method", "streambp", "--objective", "grpo", "-b", "2", "--head-mode", "fused"]
    result = CliRunner().invoke(app, [*args, "--json"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["spec"]["head_mode"] == "fused" and report["ok"]
    assert "streambp head fused" in CliRunner().invoke(app, args).stdout


def test_the_sharded_verify_has_no_head_it_does_not_run() -> None:
    result = CliRunner().invoke(app, ["verify", "fsdp", "-m", TINY, "--nproc", "2", "--head-mode", "fused"])
    one_line_error(result, "No such option: --head-mode")


@pytest.mark.parametrize("command", ["max-len", "sweep", "verify"])
def test_help_shows_the_option_and_an_example(command: str) -> None:
    result = CliRunner().invoke(app, [command, "--help"], env={"COLUMNS": "200"})
    assert "--head-mode" in result.output and "auto|fused|recompute" in result.output
    assert any(line.strip().startswith(f"streambp-bench {command}") and "--head-mode" in line
               for line in result.output.splitlines())
