"""`sweep --packing` / `max-len --packing`: packed rows' attention work beside the unpacked figures."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_core.config import StepSpec
from streambp_core.step.estimate.packed import packed_attention
from streambp_core.step.estimate.roofline import gpu_model
from tests.cli.errors import one_line_error


def test_packed_attention_is_the_sum_of_squares_and_scales_the_estimate():
    spec = StepSpec.of(model="tiny/llama", method="streambp", seq_len_tokens=200, partition_size=64,
                       head_partition_size=32)
    note = packed_attention(spec, [[100, 50, 50]], gpu_model("h100"))
    assert note.attention_flops_fraction == (100**2 + 2 * 50**2) / 200**2
    assert note.attention_ms > 0 and note.saved_ms == note.attention_ms * (1 - 0.375)
    assert packed_attention(spec, [[200]]).saved_ms is None


def test_sweep_reports_packing(tmp_path):
    args = ["sweep", "-m", "tiny/llama", "--device", "sim", "--method", "streambp", "--seq-len", "128,256",
            "--ps", "64", "--ps-head", "32", "--packing", "100,50,50", "--gpu-model", "h100",
            "--out", str(tmp_path / "s.csv"), "--json"]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output
    notes = json.loads(result.stdout)["packing"]
    assert [n["seq_len_tokens"] for n in notes] == [256], "200 tokens of documents do not fit in 128"
    assert notes[0]["attention_flops_fraction"] == (100**2 + 2 * 50**2) / 256**2
    assert notes[0]["source"] == "estimated" and 0 < notes[0]["saved_ms"] < notes[0]["attention_ms"]


def test_bad_packing_text_is_one_error_line(tmp_path):
    result = CliRunner().invoke(app, ["max-len", "-m", "tiny/llama", "--packing", "3,x"])
    one_line_error(result, "--packing takes a document count or lengths")
