"""benchmarks/fsdp_rank_memory.py: bad input is one `error:` line and exit 2, before any rank starts."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]


def _script():
    folder = REPO / "benchmarks"
    sys.path.insert(0, str(folder))  # the script imports its sibling csv_out
    try:
        spec = importlib.util.spec_from_file_location("fsdp_rank_memory", folder / "fsdp_rank_memory.py")
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        sys.path.remove(str(folder))
    return module


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--shards", "zero1"], ["shard must be one of"]),
        (["--shards", "deepspeed-zero2"], ["torch FSDP2"]),
        (["--methods", "nosuch"], ["unknown method 'nosuch'"]),
        (["--gpus", "1"], ["--gpus must be at least 2"]),
        (["--gpus", "4096"], ["more than the"]),
    ],
)
def test_bad_input_is_one_line_before_any_rank_starts(args, words, capsys):
    assert _script().main(args) == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: ") and all(w in lines[0] for w in words), lines
